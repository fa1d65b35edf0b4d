"""Who goes next and where: admission, the dispatcher, waits, quotas and usage accounting."""
