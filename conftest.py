"""Repository-level pytest configuration (markers and defaults only)."""
