"""The ``fairgate`` console script's composition root (see ``fairgate.cli``).

The product is ``gateway`` + ``policies``; the test rig is ``loadtest``. This package is
the one place that knows both, so the gateway never imports its test rig.
"""
