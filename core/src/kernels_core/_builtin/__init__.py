"""The core's built-in plugin (placeholder until the loader lands)."""
