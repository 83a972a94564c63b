"""ragcache."""
