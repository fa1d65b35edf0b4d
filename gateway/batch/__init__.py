"""The Batch API's own parts: files, batch records, reading input lines, the runner."""
