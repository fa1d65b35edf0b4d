"""The ground floor every part may import: errors and their one rendering (the edge), settings,
logs, metrics, supervision."""
