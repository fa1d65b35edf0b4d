from tests.gateway.conftest import gateway, sim  # noqa: F401  (shared fixtures)
