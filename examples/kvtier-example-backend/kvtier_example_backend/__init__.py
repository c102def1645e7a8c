"""An example third-party kvtier backend that stores pages as rows of one SQLite file."""
