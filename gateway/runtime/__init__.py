"""Starting and supervising processes: the command line and the worker processes."""
