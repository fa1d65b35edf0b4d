"""Per-user and per-tenant series, bounded to the top users and tenants (the rest:
``other``), and the service shares the share ratio is computed from
(``gateway/ops/history.py`` flushes them to Redis)."""

from __future__ import annotations

import time
from collections.abc import Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge

from gateway.core.metrics.base import SHARED, Children, MetricGroup
from gateway.core.user_series import MAX_SHARE_USERS, OTHER_USERS, ServiceShares, UserLabels


class UsageMetrics(MetricGroup):
    def __init__(self, r: CollectorRegistry, child: Children, top_users: int,
                 user_idle_s: float, multiprocess: bool) -> None:
        super().__init__(child)
        self.multiprocess = multiprocess
        self.users = UserLabels(top_users, user_idle_s)
        self.tenants = UserLabels(top_users, user_idle_s)  # tenants: bounded alike
        self.shares: dict[str, ServiceShares] = {}
        # service not yet added to the cross-replica shares in Redis (gateway/ops/history.py)
        self.pending_service: dict[str, dict[str, float]] = {}
        # model -> user -> (tenant, weight, tenant weight) of users queued since the last
        # flush: the share ratio needs the weight of a backlogged user not served yet
        self.pending_who: dict[str, dict[str, tuple[str, float, float]]] = {}
        self._share_series: set[tuple[str, str, str]] = set()
        self._user_series: dict[str, set[tuple[Counter, tuple[str, ...]]]] = {}
        self.user_tokens = Counter(
            "fairgate_user_tokens_total", "Tokens served per user (top users, rest: other)",
            ["model", "user", "kind"], registry=r)
        self.user_requests = Counter(
            "fairgate_user_requests_total", "Requests dispatched per user (top users, rest: other)",
            ["model", "user"], registry=r)
        self.user_service = Counter(
            "fairgate_user_service_total",
            "Weighted service per user: (prompt × w_in + output × w_out) / key weight",
            ["model", "user"], registry=r)
        self.user_preemptions = Counter(
            "fairgate_user_preemptions_total",
            "Running requests preempted per user and class (top users, rest: other)",
            ["model", "user", "priority_class"], registry=r)
        self.user_preempted_tokens = Counter(
            "fairgate_user_preemption_recomputed_tokens_total",
            "Tokens the preempted answers of each user send again, per class (top users, "
            "rest: other)", ["model", "user", "priority_class"], registry=r)
        self.tenant_requests = Counter(
            "fairgate_tenant_requests_total",
            "Finished requests per tenant, by outcome (top tenants, rest: other)",
            ["tenant", "priority_class", "outcome"], registry=r)
        self.tenant_tokens = Counter(
            "fairgate_tenant_tokens_total", "Tokens served per tenant (top tenants, rest: other)",
            ["tenant", "kind"], registry=r)
        self.tenant_limit_refusals = Counter(
            "fairgate_tenant_limit_refusals_total",
            "Requests refused by a key's or tenant's limits, per tenant: rate_limit_exceeded "
            "or insufficient_quota", ["tenant", "code"], registry=r)
        self.share_ratio = Gauge(
            "fairgate_share_ratio",
            "Served ÷ entitled share of each backlogged tenant and user: its share of the "
            "model's recent (decayed, 60 s half-life) service across every replica against "
            "its weight's share among the backlogged; 1 is exactly fair "
            "(policies/share_ratio.py)", ["model", "level", "name"], registry=r,
            multiprocess_mode=SHARED)

    def on_dispatched(self, model: str, user: str) -> None:
        self._user_inc(self.user_requests, (model,), user, 1.0)

    def on_served(self, model: str, user: str, prompt_tokens: int, output_tokens: int,
                  service: float) -> None:
        """An answer went out (or failed): the user's tokens and service, its share."""
        label = self._user_label(user)  # once for its three series
        self._labelled_inc(self.user_tokens, (model, label, "prompt"), label, prompt_tokens)
        self._labelled_inc(self.user_tokens, (model, label, "completion"), label,
                           output_tokens)
        self._labelled_inc(self.user_service, (model, label), label, service)
        shares = self.shares.get(model)
        if shares is None:  # not built per answer just to be thrown away
            shares = self.shares[model] = ServiceShares()
        shares.add(user, service, time.monotonic())
        pending = self.pending_service.setdefault(model, {})
        if service > 0 and (user in pending or len(pending) < MAX_SHARE_USERS):
            pending[user] = pending.get(user, 0.0) + service

    def on_preempted(self, model: str, user: str, klass: str, tokens: int) -> None:
        """A running answer of ``user`` was preempted; its continuation sends ``tokens``
        again."""
        label = self._user_label(user)
        self._labelled_inc(self.user_preemptions, (model, label, klass), label, 1.0)
        self._labelled_inc(self.user_preempted_tokens, (model, label, klass), label, tokens)

    def preempted_view(self) -> dict[str, dict[str, float]]:
        """This replica's preemptions per labelled user ("model · class · user"): how
        many, and the tokens they send again (the dashboard's preemption panel)."""
        out: dict[str, dict[str, float]] = {}
        for counter, field in ((self.user_preemptions, "preemptions"),
                               (self.user_preempted_tokens, "tokens")):
            for family in counter.collect():
                for s in family.samples:
                    if s.name.endswith("_total"):
                        what = " · ".join((s.labels["model"], s.labels["priority_class"],
                                           s.labels["user"]))
                        out.setdefault(what, {})[field] = s.value
        return out

    def on_queued(self, model: str, user: str, tenant: str, weight: float,
                  tenant_weight: float) -> None:
        """A request of ``user`` (in ``tenant``, "": its own) was queued: who it is goes to
        the shares in Redis with the next flush (bounded like the service)."""
        pending = self.pending_who.setdefault(model, {})
        if user in pending or len(pending) < MAX_SHARE_USERS:
            pending[user] = (tenant, weight, tenant_weight)

    def set_share_ratios(self, model: str, tenants: Mapping[str, float],
                         users: Mapping[str, float]) -> None:
        """``fairgate_share_ratio`` of ``model`` now: series for those given (users and
        tenants within the label caps), the model's others removed."""
        shown: set[tuple[str, str, str]] = set()
        for level, ratios, labelled in (("tenant", tenants, self._tenant_label),
                                        ("user", users, self._user_label)):
            for name, ratio in ratios.items():
                label = labelled(name)
                if label != OTHER_USERS:
                    shown.add((model, level, label))
                    self.share_ratio.labels(model, level, label).set(ratio)
        for series in [s for s in self._share_series if s[0] == model and s not in shown]:
            if self.multiprocess:  # a removed series keeps its last value there
                self.share_ratio.labels(*series).set(float("nan"))
            self.share_ratio.remove(*series)
            self._share_series.discard(series)
        self._share_series |= shown

    def on_tenant_usage(self, tenant: str, klass: str, prompt_tokens: int,
                        output_tokens: int, error: bool) -> None:
        label = self._tenant_label(tenant)
        self.child(self.tenant_requests, label, klass, "error" if error else "ok").inc()
        if prompt_tokens:
            self.child(self.tenant_tokens, label, "prompt").inc(prompt_tokens)
        if output_tokens:
            self.child(self.tenant_tokens, label, "completion").inc(output_tokens)

    def on_limit_refused(self, tenant: str, code: str) -> None:
        self.tenant_limit_refusals.labels(self._tenant_label(tenant), code).inc()

    def _tenant_label(self, tenant: str) -> str:
        """At most ``top_users`` tenant label values (rest: ``other``); an idle tenant's
        series give way to an active one's, as users' do."""
        label, expired = self.tenants.label(tenant, time.monotonic())
        for gone in expired:
            for metric in (self.tenant_requests, self.tenant_tokens,
                           self.tenant_limit_refusals):
                for labels in [k for k in metric._metrics if k[0] == gone]:
                    self.child.remove(metric, tuple(labels))
        return label

    def _user_label(self, user: str) -> str:
        """At most ``top_users`` user label values (rest: ``other``); an idle user's
        series give way to an active one's."""
        label, expired = self.users.label(user, time.monotonic())
        for gone in expired:
            for metric, labels in self._user_series.pop(gone, set()):
                self.child.remove(metric, tuple(labels))
        return label

    def _user_inc(self, counter: Counter, head: tuple[str, ...], user: str, amount: float,
                  tail: tuple[str, ...] = ()) -> None:
        label = self._user_label(user)
        self._labelled_inc(counter, (*head, label, *tail), label, amount)

    def _labelled_inc(self, counter: Counter, labels: tuple[str, ...], label: str,
                      amount: float) -> None:
        """Add ``amount`` to the series ``labels`` of the user labelled ``label``."""
        if label != OTHER_USERS:
            self._user_series.setdefault(label, set()).add((counter, labels))
        self.child(counter, *labels).inc(amount)
