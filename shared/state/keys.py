"""Every Redis key and channel, built in one place under a configurable prefix."""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass


@dataclass(frozen=True)
class Keys:
    prefix: str = "acd"

    def worker(self, worker_id: str) -> str:
        """Hash: address, device, models. Its TTL is the worker's heartbeat."""
        return f"{self.prefix}:workers:{worker_id}"

    def placement(self, model: str) -> str:
        """Set of worker ids that serve `model`."""
        return f"{self.prefix}:placement:{model}"

    def placements(self) -> str:
        """Set of model names that have a placement key (for listing without SCAN)."""
        return f"{self.prefix}:placements"

    def models(self) -> str:
        """Hash: model name -> ModelSpec JSON (the gateway's catalogue)."""
        return f"{self.prefix}:models"

    def ramps(self, worker_id: str) -> str:
        """Hash, model -> JSON: a worker's exit ramps (active, thresholds, agreement, changes); with a TTL."""
        return f"{self.prefix}:ramps:{worker_id}"

    def tokenizer(self, digest: str) -> str:
        """String: a user's model's tokenizer.json, by its sha256 (the gateway tokenizes with it)."""
        return f"{self.prefix}:tokenizer:{digest}"

    def students(self, model: str) -> str:
        """String: the student number S the resource manager chose for a student model."""
        return f"{self.prefix}:students:{model}"

    def groups(self, model: str) -> str:
        """String (JSON): the student groups of a student model, eq. 6 (see resource_manager.core)."""
        return f"{self.prefix}:groups:{model}"

    def profile(self, model: str) -> str:
        """Hash: the start-up profile's choice for a model (instances per device, max_merge)."""
        return f"{self.prefix}:profile:{model}"

    def tenant(self, tenant_id: str) -> str:
        """Hash: a tenant's record (created, quota rate and burst)."""
        return f"{self.prefix}:tenant:{tenant_id}"

    def tenants(self) -> str:
        """Set of tenant ids."""
        return f"{self.prefix}:tenants"

    def tenant_models(self, tenant_id: str) -> str:
        """Hash: a tenant's model name -> TenantModel JSON (base, adapter version, labels, status)."""
        return f"{self.prefix}:tenant_models:{tenant_id}"

    def tenant_models_changed(self) -> str:
        """Counter: bumped on every change to any tenant's models (workers re-read them only then)."""
        return f"{self.prefix}:tenant_models_changed"

    def quota(self, tenant_id: str) -> str:
        """Hash: the tenant's request token bucket (tokens, at), updated atomically by a Lua script."""
        return f"{self.prefix}:quota:{tenant_id}"

    def quota_refund(self, refund_id: str) -> str:
        """String with a short TTL: marks one token given back, so that a retried refund gives nothing."""
        return f"{self.prefix}:quota-refund:{refund_id}"

    def adapter(self, tenant_id: str, name: str) -> str:
        """Hash: one adapter's versions (JSON), latest version, metadata. Weights live in the store's files."""
        return f"{self.prefix}:adapter:{tenant_id}:{name}"

    def adapters(self, tenant_id: str) -> str:
        """Set of a tenant's adapter names."""
        return f"{self.prefix}:adapters:{tenant_id}"

    def adapter_store(self) -> str:
        """String: the adapter store's address (set with the heartbeat TTL)."""
        return f"{self.prefix}:adapter_store"

    def job(self, job_id: str) -> str:
        """Hash: a Manage API job (kind, tenant, status, progress, message, result JSON)."""
        return f"{self.prefix}:job:{job_id}"

    def jobs(self) -> str:
        """List: job ids waiting for a trainer (LPUSH by the gateway; a trainer moves the oldest to
        jobs_running, see shared/state/jobs.py)."""
        return f"{self.prefix}:jobs"

    def jobs_running(self) -> str:
        """List: job ids a trainer has claimed (moved from Keys.jobs() in one step, so none is lost)."""
        return f"{self.prefix}:jobs:running"

    def job_lease(self, job_id: str) -> str:
        """String: the trainer id running the job, with a TTL it renews; gone: the job is re-queued."""
        return f"{self.prefix}:job_lease:{job_id}"

    def domain(self, name: str) -> str:
        """Hash: a PLOT domain (status, overlay dir, top percent, job)."""
        return f"{self.prefix}:domain:{name}"

    def domains(self) -> str:
        """Set of domain names."""
        return f"{self.prefix}:domains"

    def api_key(self, key: str) -> str:
        """Hash: tenant, role. Only the key's SHA-256 is stored, never the key."""
        return self.api_key_of_digest(hash_key(key))

    def api_key_of_digest(self, digest: str) -> str:
        return f"{self.prefix}:apikey:{digest}"

    def api_key_pattern(self) -> str:
        """Matches every API key's hash (a SCAN pattern)."""
        return f"{self.prefix}:apikey:*"

    def scheduler(self, scheduler_id: str) -> str:
        """String: address. Its TTL is the scheduler's heartbeat."""
        return f"{self.prefix}:schedulers:{scheduler_id}"

    def schedulers(self) -> str:
        """Set of scheduler ids (members whose heartbeat expired are skipped and pruned)."""
        return f"{self.prefix}:schedulers"

    def gateway(self, gateway_id: str) -> str:
        """Hash: address, http (its HTTP/JSON API's address, empty without one), tls ("1": its ports serve TLS, whose
        certificate holds server_name).
        Its TTL is the gateway's heartbeat. Nothing reads it on the request path: `academus status` lists them."""
        return f"{self.prefix}:gateways:{gateway_id}"

    def gateways(self) -> str:
        """Set of gateway ids (members whose heartbeat expired are skipped)."""
        return f"{self.prefix}:gateways"

    def timing(self, policy: str, model: str) -> str:
        """Hash: a deployment's smoothed batch times for `model` (service_s, batch_texts, token_s, token_dev), which
        its schedulers report; a scheduler that starts (or restarts) admits on them until it has timed its own."""
        return f"{self.prefix}:timing:{policy}:{model}"

    def load(self, scheduler_id: str) -> str:
        """Hash: queue depth, idle groups, and `models` (JSON: per-model buffer/groups/idle/busy)."""
        return f"{self.prefix}:load:{scheduler_id}"

    def plot(self, plot_id: str) -> str:
        """Hash: address, model, lower_layers, domains of one plot service. Its TTL is the heartbeat."""
        return f"{self.prefix}:plot:{plot_id}"

    def plots(self) -> str:
        """Set of plot service ids (members whose heartbeat expired are skipped and pruned)."""
        return f"{self.prefix}:plots"

    def resource_manager(self) -> str:
        return f"{self.prefix}:resource_manager"

    def events(self) -> str:
        """Pub/sub channel: placement and catalogue changes, and a node scheduler's `serving <id>`."""
        return f"{self.prefix}:events"


def new_api_key(tenant: str) -> str:
    """A fresh API key (shown once; only `hash_key` of it is stored), naming its tenant for operators."""
    return f"acd_{tenant}_" + secrets.token_urlsafe(24)


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()
