"""Test helpers and the conformance kit that third-party backends import and run."""
