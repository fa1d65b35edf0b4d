from tests.gateway.conftest import sim  # noqa: F401  (shared fixtures)
