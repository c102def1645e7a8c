"""The plugin system: hook markers, hook specifications, the manager and registries."""
