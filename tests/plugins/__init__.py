"""Components a user writes outside the package: one file each, selected by a config entry."""
