"""What operators read: the read model behind /admin and the dashboard, and the history."""
