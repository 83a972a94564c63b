"""blend."""
