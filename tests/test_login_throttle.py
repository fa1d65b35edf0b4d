"""The failed-login throttle's decision (policies/login_throttle.py), pure."""

from __future__ import annotations

from policies.login_throttle import LoginFailures


def test_a_window_of_failures_then_a_wait_until_it_ends() -> None:
    table = LoginFailures()
    for i in range(3):
        assert table.retry_after_s("a", 100.0 + i, 3, 60.0) is None, i
        table.failed("a", 100.0 + i, 60.0)
    assert table.retry_after_s("a", 103.0, 3, 60.0) == 57
    assert table.retry_after_s("b", 103.0, 3, 60.0) is None  # per address
    assert table.retry_after_s("a", 159.5, 3, 60.0) == 1
    assert table.retry_after_s("a", 160.0, 3, 60.0) is None  # the window ended
    table.failed("a", 160.0, 60.0)  # a new window, one failure
    assert table.retry_after_s("a", 161.0, 3, 60.0) is None


def test_the_table_is_bounded_ended_windows_forgotten_first() -> None:
    table = LoginFailures(max_clients=3)
    table.failed("old", 0.0, 10.0)
    for client in ("x", "y"):
        for _ in range(2):
            table.failed(client, 5.0, 10.0)
    table.failed("new", 12.0, 10.0)  # full: "old"'s window ended, it goes
    assert len(table) == 3, len(table)
    assert table.retry_after_s("x", 12.0, 2, 10.0) == 3
    for i in range(10):  # a flood of addresses: the table stays at its bound
        table.failed(f"flood-{i}", 13.0, 10.0)
    assert len(table) == 3, len(table)
