"""One typed, frozen config tree: embedded defaults -> TOML file -> environment -> CLI.

Primitives:
- ``Config`` and its sections (``ServerConfig``, ``DeviceTierConfig``, ``HostTierConfig``,
  ``PrivateTierConfig``, ``DiskTierConfig``, ``RemoteTierConfig``, ``PolicyConfig``, ``LeaseConfig``,
  ``CopyConfig``, ``MetricsConfig``); each field carries its default and description.
- ``TenantConfig``: one ``[tenants.<name>]`` table (``token_sha256`` or ``token_file``,
  ``quota = { device, host, disk }``, ``trusted_local``); ``Config.tenants`` maps names to them.
- ``Config.remote_options``: the remote tier's ``RemoteOptions``, or None when it is off
  (its keys read from ``key_file`` and ``old_key_files``: ``remote_keys``, ``read_key_file``).
- ``load(path=None, env=os.environ, overrides={}) -> Config``.
- ``parse_size("64MiB") -> int``.
- ``ConfigError``: a start-up error naming the key and the valid choices.
- ``reference() -> list[(key, default, help)]``: feeds docs/config.md.
- ``to_toml(config=None) -> str``: the whole tree as TOML that ``load`` reads back (sizes
  as strings like "8GiB", each key preceded by its description and, for enumerated keys,
  its choices); without ``config``, the defaults.
- ``format_size(n) -> str``: bytes as the largest exact binary unit ("8GiB", else bytes).

Environment overrides are ``KVPARK__<SECTION>__<KEY>``, upper case, with ``__``
between levels: ``KVPARK__TIERS__HOST__CAPACITY=2GiB``. Overrides from the CLI use
dotted keys: ``{"tiers.disk.path": "/data"}``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import re
import tomllib
import typing
from dataclasses import dataclass, field
from typing import Any, Mapping

from kvpark.tiers.policy import POLICIES
from kvpark.tiers.remote import RemoteOptions
from kvpark.tiers.shm import free_bytes

from .sockets import unix_path

log = logging.getLogger("kvpark.config")

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
}


class ConfigError(ValueError):
    """Invalid configuration: names the key and what would be valid."""


def parse_size(value: int | str, key: str = "size") -> int:
    if isinstance(value, bool):
        raise ConfigError(f"{key}: expected a size like 4GiB or an integer byte count, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"{key}: size must be >= 0, got {value}")
        return value
    if isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", value)
        if m and m.group(2).lower() in _UNITS:
            return int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    raise ConfigError(
        f"{key}: expected a size like 64MiB, 2GiB or an integer byte count, got {value!r} "
        f"(units: {', '.join(u for u in _UNITS if u)})"
    )


def _f(default: Any, help: str, *, choices: tuple[Any, ...] | None = None, size: bool = False,
       auto: bool = False, tristate: bool = False, paths: bool = False) -> Any:
    meta = {"help": help, "choices": choices, "size": size, "auto": auto, "tristate": tristate, "paths": paths}
    return field(default=default, metadata=meta)


def _default_data_dir() -> str:
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return os.path.join(base, "kvpark")


@dataclass(frozen=True)
class ServerConfig:
    listen: str = _f("127.0.0.1:50551", "gRPC address: host:port (port 0 picks one) or unix:///path")
    max_workers: int = _f(32, "gRPC handler threads")
    grace_s: float = _f(5.0, "seconds in-flight calls get to finish on a graceful stop")
    chunk_size: int = _f(1 << 20, "inline transport message payload size", size=True)
    data_channel: bool = _f(True, "offer inline clients a raw-socket data channel for bulk bytes (one-time tokens "
                                  "from Reserve/Acquire); false: bulk bytes stay on gRPC streams")
    data_channel_listen: str = _f("", 'data channel address: host:port (port 0 picks one) or unix:///path; "" = '
                                      "the gRPC host on a free port, or <gRPC unix path>.data")
    log_level: str = _f("info", "log level", choices=("debug", "info", "warning", "error"))
    log_format: str = _f("text", "log lines: text for people, json (one object per line) for log shippers",
                         choices=("text", "json"))
    tls_cert: str = _f("", "PEM certificate chain file; with tls_key, gRPC is served over TLS")
    tls_key: str = _f("", "PEM private key file of tls_cert")
    tls_client_ca: str = _f("", "PEM CA bundle file; set: every client must present a certificate it signed (mTLS)")
    insecure: bool = _f(False, "allow listening on a non-loopback address without tenants or without TLS "
                        "(anyone who reaches the port can read and drop everything; tokens travel in clear)")
    socket_group: str = _f("", 'a unix-socket listen address is mode 0600 (owner only); a group name here '
                           "makes it 0660 with that group")


@dataclass(frozen=True)
class DeviceTierConfig:
    enabled: str = _f("auto", '"auto" (on when CUDA is available), "true" or "false"',
                      choices=("auto", "true", "false"), tristate=True)
    device: str = _f("cuda:0", 'torch device of the pool; "cpu" is a stand-in that runs the same logic in tests')
    capacity: int | str = _f("auto", "device pool size; auto = auto_fraction of what the GPU has free at start, "
                             "between auto_min and auto_max (off, with the reason logged, when even auto_min "
                             "would take more than half of the free memory)", size=True, auto=True)
    auto_fraction: float = _f(0.05, "share of the GPU's free memory an auto-sized pool takes (small: an engine "
                              "started next, such as vLLM, wants gpu_memory_utilization of the whole GPU)")
    auto_min: int = _f(256 << 20, "smallest auto-sized pool", size=True)
    auto_max: int = _f(8 << 30, "largest auto-sized pool", size=True)
    high_watermark: float = _f(0.0, "usage fraction that starts demotion to host; 0 = policy.high_watermark")
    low_watermark: float = _f(0.0, "usage fraction demotion brings it down to; 0 = policy.low_watermark")


@dataclass(frozen=True)
class HostTierConfig:
    capacity: int | str = _f(
        "auto", "host arena size; auto = 1/8 of RAM, between 256MiB and 4GiB, cut down to what shm_dir can "
        "hold (floor 32MiB)", size=True, auto=True
    )
    slot_size: int = _f(1 << 20, "arena slot size (power of two, 64KiB..64MiB); tails pack in slot/64 granules",
                        size=True)
    shm_dir: str = _f("/dev/shm", "existing directory (a tmpfs) of the shared-memory arena file (mode 0600, "
                      'memory reserved at start, removed on stop); "" = private memory, no shm transport')
    prefault: bool = _f(True, "touch every arena page at start so no page fault lands in the hot path")
    window_size: int = _f(0, "a sequence larger than its memory tier parks to disk and restores through one window "
                          "of slots this large; 0 = auto (a quarter of the tier, at most 256MiB); whole slots",
                          size=True)
    group: str = _f("", 'the arena file is mode 0600 (owner only); a group name here makes it 0660 with that '
                    "group, for shm clients running as other users")
    high_watermark: float = _f(0.0, "usage fraction that starts demotion to disk; 0 = policy.high_watermark")
    low_watermark: float = _f(0.0, "usage fraction demotion brings it down to; 0 = policy.low_watermark")


@dataclass(frozen=True)
class PrivateTierConfig:
    capacity: int = _f(0, "daemon-private host memory holding the sequences of tenants that are not trusted_local "
                       "(no client can map it: never a file, never offered by Hello); 0 = auto: a quarter of "
                       "tiers.host.capacity. Only a daemon with such a tenant has this tier", size=True)
    high_watermark: float = _f(0.0, "usage fraction that starts demotion to disk; 0 = policy.high_watermark")
    low_watermark: float = _f(0.0, "usage fraction demotion brings it down to; 0 = policy.low_watermark")


@dataclass(frozen=True)
class DiskTierConfig:
    path: str = _f("", "LMDB directory; empty = $XDG_DATA_HOME/kvpark (else ~/.local/share/kvpark)")
    capacity: int = _f(64 << 30, "payload bytes the disk tier may hold; LMDB map_size follows it", size=True)
    writemap: bool = _f(False, "LMDB writemap; off measured 1.1-3x faster for our write pattern (bench/lmdb_write.py)")
    direct_reads: bool = _f(True, "trusted_local clients on this host read sequences that are on disk only straight "
                            "from the LMDB files (a disk grant: one verified copy, no promotion before the read); "
                            "offered only while no tenant is untrusted, since the files hold every tenant's bytes")


@dataclass(frozen=True)
class RemoteTierConfig:
    url: str = _f("", 'Redis URL of the remote tier below disk, e.g. "redis://127.0.0.1:6379/0" (rediss:// for '
                  'TLS, user:password@ for ACLs); "" = no remote tier')
    cluster: bool = _f(False, "true: Redis Cluster, and url is one seed node")
    namespace: str = _f("kvpark", "key prefix, so several fleets can share one Redis")
    write: str = _f("on_evict", "on_evict: what the disk evicts goes to remote instead of being dropped; "
                    "write_through: every park is also copied to remote in the background after its ack",
                    choices=("on_evict", "write_through"))
    ttl_s: float = _f(0.0, "TTL on every remote key; 0 = no expiry")
    timeout_s: float = _f(2.0, "per remote operation (connect, each socket read or write)")
    chunk_size: int = _f(4 << 20, "largest remote value; larger blocks are split so they spread over cluster "
                         "slots", size=True)
    inflight: int = _f(4, "pipelines in flight at once for one sequence, each on its own connection")
    evict_parallel: int = _f(4, "sequences a disk eviction moves to remote at once, so one's Redis round trips, "
                             "LMDB read and delete overlap the others' (1: one at a time)")
    breaker_failures: int = _f(3, "consecutive failed remote calls that open the circuit breaker")
    breaker_cooldown_s: float = _f(5.0, "seconds an open breaker fails remote calls fast before one probe")
    max_pending: int = _f(1024, "write_through copies waiting for Redis at most; past it a copy is skipped "
                          "(counted, logged) and the sequence stays local until disk eviction copies it")
    key_file: str = _f("", "file holding the remote tier's key: 64 hex digits (32 bytes, e.g. openssl rand -hex 32), "
                       "mode 0600; set: every value in Redis is sealed with AES-256-GCM (encrypted, authenticated, "
                       'bound to its key), and a value that does not open is DATA_LOSS and deleted; "" = plain '
                       "values, checksummed only: anyone who can write to the Redis can plant or alter KV")
    old_key_files: tuple[str, ...] = _f((), "key files of earlier keys (same format), for rotation: values sealed "
                                        "with them are still read, and re-sealed with key_file in the background",
                                        paths=True)


@dataclass(frozen=True)
class TiersConfig:
    device: DeviceTierConfig = field(default_factory=DeviceTierConfig)
    host: HostTierConfig = field(default_factory=HostTierConfig)
    private: PrivateTierConfig = field(default_factory=PrivateTierConfig)
    disk: DiskTierConfig = field(default_factory=DiskTierConfig)
    remote: RemoteTierConfig = field(default_factory=RemoteTierConfig)


@dataclass(frozen=True)
class PolicyConfig:
    eviction: str = _f("lru", "eviction policy", choices=tuple(POLICIES))
    write: str = _f("write_back", "write_back: disk only on demotion; write_through: every park lands on disk "
                    "before it is acknowledged", choices=("write_back", "write_through"))
    disk_full: str = _f("evict", "evict: a disk past its high watermark (or a write that does not fit) drops its "
                        "coldest unpinned, unleased sequences (to the remote tier first when one is set); "
                        "refuse: parks fail with RESOURCE_EXHAUSTED instead", choices=("evict", "refuse"))
    high_watermark: float = _f(0.9, "host usage fraction that starts background demotion")
    low_watermark: float = _f(0.8, "host usage fraction background demotion brings it down to")
    promote_on_restore: bool = _f(True, "restoring a disk-resident sequence copies it back to host when there is room "
                                   "(after a disk grant, in the background once reads and parks pause for 50 ms, "
                                   "or after 1 s: the read does not wait for it, nor compete with it)")
    flush_on_shutdown: bool = _f(True, "a graceful stop writes every host-only sequence to disk first")
    max_dirty_s: float = _f(30.0, "write_back: a sequence memory-only for longer is written to disk in the "
                            "background (a stop, or a crash, then loses or drains at most this much); 0 = no bound")
    max_dirty_bytes: int = _f(1 << 30, "write_back: while more than this is memory-only, the oldest is written to "
                              "disk in the background; 0 = no bound", size=True)
    max_dirty_sequences: int = _f(100_000, "write_back: while more sequences than this are memory-only, the "
                                  "oldest is written to disk in the background (a stop drains about 10k-30k a "
                                  "second); 0 = no bound")
    restore_to: str = _f("auto", 'tier a restore promotes into before serving: "device", "host", or "auto" '
                         "(the tier the reader copies from: device for cuda_ipc, host for shm and streamed "
                         'or small restores); "device" also lands inline parks on the device tier (else they '
                         "land on host)", choices=("auto", "device", "host"))


@dataclass(frozen=True)
class CopyConfig:
    max_inflight_bytes: int = _f(256 << 20, "bytes in flight per direction (H2D, D2H) in the copy engine",
                                 size=True)


@dataclass(frozen=True)
class LeaseConfig:
    ttl_s: float = _f(30.0, "seconds a shm reservation or read lease lives without being committed/released")


@dataclass(frozen=True)
class MetricsConfig:
    listen: str = _f("127.0.0.1:9851", 'Prometheus /metrics address, host:port (port 0 picks one); "" = off. '
                     "A busy port stops the start-up with an error; nothing is ever sent, only scraped. Off "
                     "loopback it needs token_sha256 or server.insecure = true")
    token_sha256: str = _f("", "hex sha256 of a bearer token every scrape must carry (Authorization: Bearer "
                           '<token>; others get 401); "" = none')
    tenant_labels: bool = _f(False, "export kvpark_tenant_* series, labelled with tenant names; off: no series "
                             "names a tenant")


TENANT_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
QUOTA_TIERS = ("device", "host", "disk")
_TENANT_KEYS = ("token_sha256", "token_file", "quota", "trusted_local")


@dataclass(frozen=True)
class TenantConfig:
    """One ``[tenants.<name>]`` table, resolved: the token is kept only as its sha256."""

    name: str
    token_sha256: str  # lower-case hex; token_file is read at load and hashed
    quota: dict[str, int] = field(default_factory=dict)  # tier -> bytes; a tier not named is unlimited
    trusted_local: bool = False  # may use the shm and cuda_ipc paths


@dataclass(frozen=True)
class Config:
    server: ServerConfig = field(default_factory=ServerConfig)
    tiers: TiersConfig = field(default_factory=TiersConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    leases: LeaseConfig = field(default_factory=LeaseConfig)
    copy: CopyConfig = field(default_factory=CopyConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    # Not a section: a table of named tables, built by _tenants() (reference() skips it).
    tenants: dict[str, TenantConfig] = field(default_factory=dict, metadata={"tenants": True})

    @property
    def host_capacity(self) -> int:
        return int(self.tiers.host.capacity)  # resolved by load()

    @property
    def untrusted(self) -> tuple[str, ...]:
        """The tenants that are not ``trusted_local``: their bytes live in the private tier."""
        return tuple(name for name, t in self.tenants.items() if not t.trusted_local)

    @property
    def disk_capacity(self) -> int:
        return int(self.tiers.disk.capacity)

    @property
    def remote_options(self) -> RemoteOptions | None:
        r = self.tiers.remote
        if not r.url:
            return None
        return RemoteOptions(url=r.url, cluster=r.cluster, namespace=r.namespace, ttl_s=r.ttl_s,
                             timeout_s=r.timeout_s, chunk_size=r.chunk_size, inflight=r.inflight,
                             evict_parallel=r.evict_parallel,
                             breaker_failures=r.breaker_failures, breaker_cooldown_s=r.breaker_cooldown_s,
                             max_pending=r.max_pending, keys=remote_keys(r))


def _is_section(tp: Any) -> bool:
    return dataclasses.is_dataclass(tp)


def _convert(key: str, f: dataclasses.Field, tp: Any, value: Any) -> Any:
    meta = f.metadata
    if meta.get("auto") and value == "auto":
        return "auto"
    if meta.get("size"):
        return parse_size(value, key)
    if meta.get("paths"):
        if isinstance(value, str):  # from the environment or the command line: comma-separated
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) and v for v in value):
            raise ConfigError(f"{key}: expected a list of file paths, got {value!r}")
        return tuple(value)
    if meta.get("tristate") and isinstance(value, bool):
        return "true" if value else "false"
    if tp is bool:
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {value!r}")
        return value
    if tp is int:
        try:
            if isinstance(value, bool):
                raise ValueError
            return int(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{key}: expected an integer, got {value!r}") from None
    if tp is float:
        try:
            if isinstance(value, bool):
                raise ValueError
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{key}: expected a number, got {value!r}") from None
    if not isinstance(value, str):
        raise ConfigError(f"{key}: expected a string, got {value!r}")
    choices = meta.get("choices")
    if choices and value not in choices:
        raise ConfigError(f"{key}: {value!r} is not one of {', '.join(map(str, choices))}")
    return value


def _build(cls: type, data: Mapping[str, Any], prefix: str) -> Any:
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = set(data) - set(fields)
    if unknown:
        where = prefix.rstrip(".") or "top level"
        raise ConfigError(
            f"unknown key {prefix}{sorted(unknown)[0]!s} in {where}; valid keys: {', '.join(sorted(fields))}"
        )
    kwargs: dict[str, Any] = {}
    for name, f in fields.items():
        tp = hints[name]
        key = prefix + name
        if f.metadata.get("tenants"):
            kwargs[name] = _tenants(data.get(name, {}))
        elif _is_section(tp):
            sub = data.get(name, {})
            if not isinstance(sub, Mapping):
                raise ConfigError(f"{key}: expected a table [{key}]")
            kwargs[name] = _build(tp, sub, key + ".")
        elif name in data:
            real = float if tp is float else int if tp is int else bool if tp is bool else str
            kwargs[name] = _convert(key, f, real, data[name])
    return cls(**kwargs)


def _tenant(name: str, data: Any) -> TenantConfig:
    key = f"tenants.{name}"
    if not TENANT_NAME.fullmatch(name):
        raise ConfigError(f"{key}: a tenant name is 1-64 of A-Z a-z 0-9 _ . -")
    if not isinstance(data, Mapping):
        raise ConfigError(f"{key}: expected a table [{key}]")
    unknown = set(data) - set(_TENANT_KEYS)
    if unknown:
        raise ConfigError(f"unknown key {key}.{sorted(unknown)[0]}; valid keys: {', '.join(_TENANT_KEYS)}")
    digest, path = data.get("token_sha256", ""), data.get("token_file", "")
    if bool(digest) == bool(path):
        raise ConfigError(f"{key}: set exactly one of token_sha256 (hex sha256 of the token) or token_file")
    if path:
        try:
            with open(path, "rb") as fh:
                mode = os.fstat(fh.fileno()).st_mode & 0o777
                token = fh.read().strip()
        except OSError as e:
            raise ConfigError(f"{key}.token_file: cannot read {path}: {e.strerror or e}") from None
        if mode & 0o077:
            # A token others on the host can read is anyone's token.
            raise ConfigError(f"{key}.token_file: {path} is mode {mode:04o}, open to group or others; "
                              f"chmod 600 {path}")
        if not token:
            raise ConfigError(f"{key}.token_file: {path} is empty")
        digest = hashlib.sha256(token).hexdigest()
    if not isinstance(digest, str) or not re.fullmatch(r"[0-9a-fA-F]{64}", digest):
        raise ConfigError(f"{key}.token_sha256: expected 64 hex digits (sha256 of the token)")
    quota = data.get("quota", {})
    if not isinstance(quota, Mapping):
        raise ConfigError(f'{key}.quota: expected a table like {{ host = "8GiB", disk = "100GiB" }}')
    bad = set(quota) - set(QUOTA_TIERS)
    if bad:
        raise ConfigError(f"{key}.quota: unknown tier {sorted(bad)[0]}; valid tiers: {', '.join(QUOTA_TIERS)}")
    trusted = data.get("trusted_local", False)
    if isinstance(trusted, str) and trusted.lower() in ("true", "false"):
        trusted = trusted.lower() == "true"  # from the environment
    if not isinstance(trusted, bool):
        raise ConfigError(f"{key}.trusted_local: expected true or false, got {trusted!r}")
    return TenantConfig(name=name, token_sha256=digest.lower(),
                        quota={t: parse_size(quota[t], f"{key}.quota.{t}") for t in QUOTA_TIERS if t in quota},
                        trusted_local=trusted)


def _tenants(data: Any) -> dict[str, TenantConfig]:
    if not isinstance(data, Mapping):
        raise ConfigError("tenants: expected tables [tenants.<name>]")
    out = {name: _tenant(name, t) for name, t in data.items()}
    seen: dict[str, str] = {}
    for t in out.values():
        # One token, one identity: a shared token would make the tenant a guess.
        if t.token_sha256 in seen:
            raise ConfigError(f"tenants.{t.name}: same token as tenants.{seen[t.token_sha256]}")
        seen[t.token_sha256] = t.name
    return out


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for p in parts[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{dotted}: {p} is not a table")
    node[parts[-1]] = value


def _env_overrides(env: Mapping[str, str]) -> dict[str, str]:
    out = {}
    for k, v in env.items():
        if k.startswith("KVPARK__"):
            out[".".join(p.lower() for p in k[len("KVPARK__"):].split("__"))] = v
    return out


def _ram_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 8 << 30


AUTO_HOST_FLOOR = 32 << 20  # below this an auto-sized arena is not worth having: refuse instead


def _auto_host_capacity(shm_dir: str) -> int:
    """1/8 of RAM between 256 MiB and 4 GiB, cut down to what ``shm_dir`` can hold.

    A container's default /dev/shm is 64 MiB: the arena is sized to fit (leaving a tenth
    of the free space to others), never above it, and logged. Too little room for the
    floor is left to the arena's own check, which refuses with the fixes.
    """
    cap = min(max(_ram_bytes() // 8, 256 << 20), 4 << 30)
    if shm_dir and os.path.isdir(shm_dir):
        room = free_bytes(shm_dir) * 9 // 10
        if room < cap:
            fitted = max(room, AUTO_HOST_FLOOR)
            log.warning("tiers.host.capacity auto: %d MiB (1/8 of RAM) does not fit in %s (%d MiB free); "
                        "using %d MiB", cap >> 20, shm_dir, free_bytes(shm_dir) >> 20, fitted >> 20)
            cap = fitted
    return cap


def _resolve(cfg: Config) -> Config:
    host = cfg.tiers.host
    if host.capacity == "auto":
        host = dataclasses.replace(host, capacity=_auto_host_capacity(host.shm_dir))
    slot = host.slot_size
    if slot & (slot - 1) or not (64 << 10) <= slot <= (64 << 20):
        raise ConfigError(f"tiers.host.slot_size: must be a power of two between 64KiB and 64MiB, got {slot}")
    host = dataclasses.replace(host, capacity=(int(host.capacity) // slot) * slot)
    if host.window_size < 0:
        raise ConfigError(f"tiers.host.window_size: must be >= 0 (0 = auto), got {host.window_size}")
    if int(host.capacity) < slot:
        raise ConfigError(f"tiers.host.capacity: must hold at least one slot ({slot} bytes)")
    disk = cfg.tiers.disk
    if not disk.path:
        disk = dataclasses.replace(disk, path=_default_data_dir())
    pol = cfg.policy
    if not math.isfinite(pol.max_dirty_s) or pol.max_dirty_s < 0 or pol.max_dirty_sequences < 0:
        raise ConfigError(f"policy.max_dirty_s and policy.max_dirty_sequences: must be >= 0 (0 = no bound), got "
                          f"{pol.max_dirty_s} and {pol.max_dirty_sequences}")
    if not 0.0 < pol.low_watermark < pol.high_watermark <= 1.0:
        raise ConfigError(
            "policy.low_watermark/high_watermark: need 0 < low < high <= 1, "
            f"got low={pol.low_watermark} high={pol.high_watermark}"
        )
    private = _private(cfg, host)
    for name, t in (("tiers.device", cfg.tiers.device), ("tiers.host", host), ("tiers.private", private)):
        hi = t.high_watermark or pol.high_watermark
        lo = t.low_watermark or pol.low_watermark
        if not 0.0 < lo < hi <= 1.0:
            raise ConfigError(f"{name}.low_watermark/high_watermark: need 0 < low < high <= 1, got low={lo} high={hi}")
    dev = cfg.tiers.device
    if not 0.0 < dev.auto_fraction <= 1.0:
        raise ConfigError(f"tiers.device.auto_fraction: must be in (0, 1], got {dev.auto_fraction}")
    if not 0 < dev.auto_min <= dev.auto_max:
        raise ConfigError(f"tiers.device.auto_min/auto_max: need 0 < auto_min <= auto_max, got "
                          f"{dev.auto_min} and {dev.auto_max}")
    if pol.restore_to == "device" and dev.enabled == "false":
        raise ConfigError('policy.restore_to: "device" needs tiers.device.enabled = "auto" or "true"')
    # The usual forms are checked without torch (``kvpark config`` runs without it); any
    # other string is torch's to judge.
    if not re.fullmatch(r"(cpu|cuda|xpu|mps|meta)(:\d+)?", dev.device):
        try:
            import torch

            torch.device(dev.device)
        except (RuntimeError, TypeError) as e:
            raise ConfigError(f"tiers.device.device: {dev.device!r} is not a torch device ({e})") from None
    if cfg.leases.ttl_s <= 0:
        raise ConfigError(f"leases.ttl_s: must be > 0, got {cfg.leases.ttl_s}")
    if cfg.server.max_workers < 2:
        raise ConfigError(f"server.max_workers: must be >= 2, got {cfg.server.max_workers}")
    if cfg.metrics.listen:
        m_host, sep, m_port = cfg.metrics.listen.rpartition(":")
        if not sep or not m_host or not m_port.isdigit() or int(m_port) > 65535:
            raise ConfigError(f'metrics.listen: expected host:port or "", got {cfg.metrics.listen!r}')
    if cfg.metrics.token_sha256 and not re.fullmatch(r"[0-9a-fA-F]{64}", cfg.metrics.token_sha256):
        raise ConfigError("metrics.token_sha256: expected 64 hex digits (sha256 of the token)")
    if not (4 << 10) <= cfg.server.chunk_size <= (16 << 20):
        raise ConfigError(f"server.chunk_size: must be between 4KiB and 16MiB, got {cfg.server.chunk_size}")
    srv = cfg.server
    _check_unix_listens(srv)
    if bool(srv.tls_cert) != bool(srv.tls_key):
        raise ConfigError("server.tls_cert and server.tls_key: set both (TLS) or neither")
    if srv.tls_client_ca and not srv.tls_cert:
        raise ConfigError("server.tls_client_ca: client certificates (mTLS) need server.tls_cert and tls_key too")
    _check_remote(cfg.tiers.remote)
    return dataclasses.replace(cfg, tiers=TiersConfig(device=dev, host=host, private=private, disk=disk,
                                                      remote=cfg.tiers.remote))


def _check_unix_listens(srv: ServerConfig) -> None:
    """A unix address must name the file gRPC binds (the daemon claims that file first),
    and the data channel may not share gRPC's."""
    paths = {}
    for key, listen in (("server.listen", srv.listen), ("server.data_channel_listen", srv.data_channel_listen)):
        if listen.startswith("unix:"):
            try:
                paths[key] = os.path.abspath(unix_path(listen))
            except ValueError as e:
                raise ConfigError(f"{key}: {e}") from None
    if len(paths) == 2:
        grpc_path, dc_path = paths["server.listen"], paths["server.data_channel_listen"]
        if grpc_path == dc_path:
            raise ConfigError("server.data_channel_listen: the same unix path as server.listen; leave it \"\" "
                              "(<path>.data) or name another")
        if f"{grpc_path}.lock" == dc_path or f"{dc_path}.lock" == grpc_path:
            raise ConfigError("server.data_channel_listen: one unix path is the other's lock file (<path>.lock); "
                              "name another")


def _private(cfg: Config, host: HostTierConfig) -> PrivateTierConfig:
    """The private tier's capacity in whole slots: 0 (no tier) unless a tenant is not
    trusted_local, then the key's value or, for 0, a quarter of the host arena."""
    p, slot = cfg.tiers.private, host.slot_size
    if not cfg.untrusted:
        return dataclasses.replace(p, capacity=0)
    if p.capacity and p.capacity < slot:
        raise ConfigError(f"tiers.private.capacity: must hold at least one slot ({slot} bytes), or 0 for auto")
    cap = p.capacity or max(slot, int(host.capacity) // 4)
    return dataclasses.replace(p, capacity=cap // slot * slot)


def _check_remote(r: RemoteTierConfig) -> None:
    if r.url and not re.match(r"^(redis|rediss|unix)://", r.url):
        raise ConfigError(f"tiers.remote.url: expected redis://, rediss:// or unix://, got {r.url!r}")
    if r.cluster and r.url.startswith("unix://"):
        raise ConfigError("tiers.remote.cluster: a Redis Cluster seed is a redis:// or rediss:// url")
    if not r.namespace:
        raise ConfigError("tiers.remote.namespace: must not be empty")
    if r.ttl_s < 0:
        raise ConfigError(f"tiers.remote.ttl_s: must be >= 0, got {r.ttl_s}")
    if r.timeout_s <= 0:
        raise ConfigError(f"tiers.remote.timeout_s: must be > 0, got {r.timeout_s}")
    if not (64 << 10) <= r.chunk_size <= (512 << 20):
        raise ConfigError(f"tiers.remote.chunk_size: must be between 64KiB and 512MiB, got {r.chunk_size}")
    if r.inflight < 1 or r.evict_parallel < 1 or r.breaker_failures < 1 or r.breaker_cooldown_s < 0:
        raise ConfigError("tiers.remote.inflight, evict_parallel and breaker_failures must be >= 1, "
                          "breaker_cooldown_s >= 0")
    if r.evict_parallel > 64:
        raise ConfigError(f"tiers.remote.evict_parallel: at most 64, got {r.evict_parallel}")
    if r.max_pending < 1:
        raise ConfigError(f"tiers.remote.max_pending: must be >= 1, got {r.max_pending}")
    if r.url:
        remote_keys(r)  # refuse a bad key file at start-up, before anything is served


def read_key_file(key: str, path: str) -> bytes:
    """The 32-byte key in ``path`` (64 hex digits, surrounding whitespace ignored), or a
    ``ConfigError``: unreadable, open to group or others, or not 64 hex digits."""
    try:
        with open(path, "rb") as fh:
            mode = os.fstat(fh.fileno()).st_mode & 0o777
            text = fh.read(4096).strip()
    except OSError as e:
        raise ConfigError(f"{key}: cannot read {path}: {e.strerror or e}") from None
    if mode & 0o077:
        # A key others on the host can read lets them read and forge everything in Redis.
        raise ConfigError(f"{key}: {path} is mode {mode:04o}, open to group or others; chmod 600 {path}")
    if not re.fullmatch(rb"[0-9a-fA-F]{64}", text):
        raise ConfigError(f"{key}: {path} must hold 64 hex digits (a 32-byte key, e.g. openssl rand -hex 32)")
    return bytes.fromhex(text.decode())


def remote_keys(r: RemoteTierConfig) -> tuple[bytes, ...]:
    """The remote tier's keys, current first, read from their files (``ConfigError``)."""
    if not r.key_file:
        if r.old_key_files:
            raise ConfigError("tiers.remote.old_key_files: needs tiers.remote.key_file (the key values are "
                              "re-sealed with)")
        return ()
    keys = [read_key_file("tiers.remote.key_file", r.key_file)]
    keys += [read_key_file(f"tiers.remote.old_key_files[{i}]", p) for i, p in enumerate(r.old_key_files)]
    return tuple(dict.fromkeys(keys))  # the current key first; a repeat is harmless


def load(
    path: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Config:
    """Build the config: defaults, then the TOML file, then env, then ``overrides``."""
    tree: dict[str, Any] = {}
    if path is not None:
        try:
            with open(path, "rb") as fh:
                tree = tomllib.load(fh)
        except FileNotFoundError:
            raise ConfigError(f"config file {path} does not exist") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {path}: {e}") from None
    # Where each key not from the file came from: an error about it names its source, so a
    # typo in an environment variable is not reported as if it were in the file.
    sources: dict[str, str] = {}
    for k, v in _env_overrides(os.environ if env is None else env).items():
        sources[k] = f"environment variable KVPARK__{'__'.join(p.upper() for p in k.split('.'))}"
        _check_key(k, sources[k])
        _set_dotted(tree, k, v)
    for k, v in (overrides or {}).items():
        sources[k] = f"--set {k}"
        _check_key(k, sources[k])
        _set_dotted(tree, k, v)
    try:
        return _resolve(_build(Config, tree, ""))
    except ConfigError as e:
        msg = str(e)
        for k in sorted(sources, key=len, reverse=True):
            if msg.startswith((k + ":", k + " ")):
                raise ConfigError(f"{msg} (set by {sources[k]})") from None
        raise


def _check_key(dotted: str, source: str) -> None:
    """Refuse a key the config tree does not have, naming ``source`` (tenant tables are
    named by the operator: their keys are checked where they are built)."""
    cls: Any = Config
    parts = dotted.split(".")
    for i, part in enumerate(parts):
        fields = {f.name: f for f in dataclasses.fields(cls)}
        f = fields.get(part)
        if f is None:
            where = ".".join(parts[:i]) or "the top level"
            raise ConfigError(f"unknown key {dotted} (set by {source}); valid keys in {where}: "
                              f"{', '.join(sorted(fields))}")
        if f.metadata.get("tenants"):
            return
        hint = typing.get_type_hints(cls)[part]
        if not _is_section(hint):
            if i != len(parts) - 1:
                raise ConfigError(f"unknown key {dotted} (set by {source}): {'.'.join(parts[:i + 1])} is a value, "
                                  "not a section")
            return
        cls = hint
    raise ConfigError(f"{dotted} (set by {source}) is a section, not a key: name one of its keys")


def reference() -> list[tuple[str, Any, str]]:
    """Every key with its default and description, in declaration order."""
    rows: list[tuple[str, Any, str]] = []

    def walk(cls: type, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.metadata.get("tenants"):
                continue  # named tables, documented on their own in docs/config.md
            if _is_section(hints[f.name]):
                walk(hints[f.name], prefix + f.name + ".")
            else:
                rows.append((prefix + f.name, f.default, f.metadata.get("help", "")))

    walk(Config, "")
    return rows


def format_size(n: int) -> str:
    """``8 << 30`` -> "8GiB"; a count that no binary unit divides stays a plain integer string."""
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return str(n)


def _toml_value(f: dataclasses.Field, value: Any) -> str:
    if f.metadata.get("size") and isinstance(value, int) and not isinstance(value, bool):
        return f'"{format_size(value)}"'
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (tuple, list)):
        return "[" + ", ".join(json.dumps(str(v), ensure_ascii=False) for v in value) + "]"
    if isinstance(value, (int, float)):
        return repr(value)
    # A TOML basic string: JSON's escapes are valid TOML escapes.
    return json.dumps(str(value), ensure_ascii=False)


def to_toml(config: Config | None = None) -> str:
    """The config (or the defaults) as commented TOML that ``load(path)`` reads back."""
    lines = ["# kvpark configuration. Every key is optional; a missing one takes its default.",
             "# Environment: KVPARK__<SECTION>__<KEY>; command line: kvpark serve --set section.key=value."]

    def walk(cls: type, obj: Any, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        plain = [f for f in dataclasses.fields(cls)
                 if not _is_section(hints[f.name]) and not f.metadata.get("tenants")]
        if plain:
            lines.extend(["", f"[{prefix.rstrip('.')}]"])
            for f in plain:
                value = getattr(obj, f.name) if obj is not None else f.default
                help_ = f.metadata.get("help", "")
                if help_:
                    lines.append(f"# {help_}")
                choices = f.metadata.get("choices")
                if choices:
                    lines.append(f"# one of: {', '.join(map(str, choices))}")
                lines.append(f"{f.name} = {_toml_value(f, value)}")
        for f in dataclasses.fields(cls):
            if _is_section(hints[f.name]):
                walk(hints[f.name], getattr(obj, f.name) if obj is not None else None, prefix + f.name + ".")

    walk(Config, config, "")
    for t in (config.tenants if config is not None else {}).values():
        lines.extend(["", f"[tenants.{t.name}]", f'token_sha256 = "{t.token_sha256}"'])
        if t.quota:
            lines.append("quota = { " + ", ".join(f'{k} = "{format_size(v)}"' for k, v in t.quota.items()) + " }")
        lines.append(f"trusted_local = {'true' if t.trusted_local else 'false'}")
    return "\n".join(lines) + "\n"
