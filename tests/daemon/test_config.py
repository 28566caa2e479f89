"""One typed config tree: defaults, TOML, env, overrides; clear errors naming the key."""

import os
from pathlib import Path

import pytest

from kvpark.daemon.config import ConfigError, load, parse_size, reference, to_toml


def test_embedded_defaults() -> None:
    c = load(env={})
    assert c.server.listen == "127.0.0.1:50551"
    assert c.policy.eviction == "lru" and c.policy.write == "write_back"
    assert (c.policy.high_watermark, c.policy.low_watermark) == (0.9, 0.8)
    assert c.policy.promote_on_restore and c.policy.flush_on_shutdown
    assert 256 << 20 <= c.host_capacity <= 4 << 30
    assert c.tiers.disk.path.endswith("kvpark")


def test_xdg_data_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    assert load(env={}).tiers.disk.path == str(tmp_path / "kvpark")


def test_toml_keys_from_the_issue(tmp_path: Path) -> None:
    f = tmp_path / "k.toml"
    f.write_text(
        '[server]\nlisten = "127.0.0.1:6000"\n[tiers.host]\ncapacity = "64MiB"\n'
        '[tiers.disk]\npath = "/tmp/x"\ncapacity = "2GiB"\n'
        '[policy]\neviction = "lru"\nwrite = "write_through"\nhigh_watermark = 0.7\nlow_watermark = 0.5\n'
        "promote_on_restore = false\nflush_on_shutdown = false\n"
    )
    c = load(f, env={})
    assert c.server.listen == "127.0.0.1:6000"
    assert c.host_capacity == 64 << 20 and c.disk_capacity == 2 << 30
    assert c.policy.write == "write_through" and not c.policy.promote_on_restore


def test_env_then_overrides(tmp_path: Path) -> None:
    env = {"KVPARK__TIERS__HOST__CAPACITY": "32MiB", "KVPARK__POLICY__WRITE": "write_through"}
    c = load(env=env, overrides={"policy.write": "write_back"})
    assert c.host_capacity == 32 << 20 and c.policy.write == "write_back"


@pytest.mark.parametrize(
    "overrides,match",
    [
        ({"tiers.host.capcity": "1GiB"}, r"tiers\.host\.capcity \(set by --set tiers.host.capcity\); valid keys in tiers.host: capacity, group, high_watermark, low_watermark, prefault, shm_dir, slot_size"),
        ({"polcy.write": "x"}, r"unknown key polcy.*valid keys in the top level: copy, leases, metrics, policy, server, tenants, tiers"),
        ({"policy.write": "sometimes"}, r"policy\.write.*write_back, write_through"),
        ({"policy.eviction": "mru"}, r"policy\.eviction.*lru"),
        ({"tiers.host.capacity": "lots"}, r"tiers\.host\.capacity.*64MiB"),
        ({"policy.high_watermark": 0.5}, r"low_watermark/high_watermark"),
        ({"policy.low_watermark": 0.0, "policy.high_watermark": 0.5}, r"need 0 < low < high <= 1"),
        ({"policy.low_watermark": 0.5, "policy.high_watermark": 1.5}, r"need 0 < low < high <= 1"),
        ({"tiers.host.low_watermark": -0.5, "tiers.host.high_watermark": 0.5},
         r"tiers\.host\.low_watermark/high_watermark: need 0 < low < high <= 1"),
        ({"server.chunk_size": "1KiB"}, r"server\.chunk_size: must be between 4KiB and 16MiB"),
        ({"server.chunk_size": "32MiB"}, r"server\.chunk_size: must be between 4KiB and 16MiB"),
        ({"tiers.host.slot_size": "3MiB"}, r"slot_size.*power of two"),
        ({"tiers.host.slot_size": "32KiB"}, r"slot_size: must be a power of two between 64KiB and 64MiB"),
        ({"tiers.host.slot_size": "128MiB"}, r"slot_size: must be a power of two between 64KiB and 64MiB"),
        ({"server.max_workers": "many"}, r"server\.max_workers: expected an integer"),
        ({"policy.flush_on_shutdown": "perhaps"}, r"flush_on_shutdown: expected true or false"),
    ],
)
def test_bad_config_names_the_key(overrides: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        load(env={}, overrides=overrides)


@pytest.mark.parametrize("env, words", [
    ({"KVPARK__TIERS__HOST__CAPACTY": "1GiB"},
     "unknown key tiers.host.capacty (set by environment variable KVPARK__TIERS__HOST__CAPACTY); valid keys in "
     "tiers.host: capacity,"),
    ({"KVPARK__TIERS__HOST__CAPACITY": "lots"},
     "(set by environment variable KVPARK__TIERS__HOST__CAPACITY)"),
    ({"KVPARK__TIERS__HOST": "1GiB"}, "tiers.host (set by environment variable KVPARK__TIERS__HOST) is a section"),
])
def test_a_bad_environment_variable_is_named_as_such_not_as_the_file(tmp_path: Path, env: dict, words: str) -> None:
    good = tmp_path / "kvpark.toml"
    good.write_text("[tiers.host]\ncapacity = \"64MiB\"\n")
    with pytest.raises(ConfigError) as e:
        load(good, env=env)
    assert words in str(e.value) and str(good) not in str(e.value)


def test_missing_and_broken_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load(tmp_path / "nope.toml", env={})
    bad = tmp_path / "bad.toml"
    bad.write_text("[server\n")
    with pytest.raises(ConfigError, match="bad.toml"):
        load(bad, env={})


def test_sizes() -> None:
    assert parse_size("64MiB") == 64 << 20
    assert parse_size("2GiB") == 2 << 30
    assert parse_size(4096) == 4096
    assert parse_size("1.5KiB") == 1536
    # Every unit, decimal and binary (a mutation pass found the decimal ones untested).
    units = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
             "t": 10**12, "tb": 10**12, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
    for unit, factor in units.items():
        assert parse_size(f"3{unit}") == 3 * factor and parse_size(f"3{unit.upper()}") == 3 * factor
    with pytest.raises(ConfigError):
        parse_size("-1")


def test_reference_covers_every_key_with_help() -> None:
    keys = {k for k, _, h in reference() if h}
    assert {"server.listen", "tiers.host.capacity", "tiers.disk.path", "policy.write", "leases.ttl_s"} <= keys


def test_docs_config_lists_every_key() -> None:
    doc = (Path(__file__).resolve().parents[2] / "docs" / "config.md").read_text()
    missing = [k for k, _, _ in reference() if f"`{k}`" not in doc]
    assert not missing, f"docs/config.md lacks {missing}"


def test_to_toml_round_trips_through_load(tmp_path: Path) -> None:
    # The defaults, and a resolved config with non-default values, both read back equal.
    defaults = tmp_path / "defaults.toml"
    defaults.write_text(to_toml())
    assert load(defaults, env={}) == load(env={})
    cfg = load(env={}, overrides={"tiers.host.capacity": "96MiB", "policy.eviction": "lfu",
                                   "server.chunk_size": 200001, "metrics.listen": ""})
    again = tmp_path / "cfg.toml"
    again.write_text(to_toml(cfg))
    assert load(again, env={}) == cfg
    text = to_toml(cfg)
    assert 'capacity = "96MiB"' in text and 'chunk_size = "200001"' in text
    assert "# one of: write_back, write_through" in text


def test_the_example_config_in_deploy_loads_and_lists_every_key() -> None:
    example = Path(__file__).resolve().parents[2] / "deploy" / "kvpark.toml"
    cfg = load(example, env={})
    assert cfg.tiers.disk.path == "/var/lib/kvpark"
    text = example.read_text()
    missing = [k for k, _, _ in reference() if f"\n{k.rsplit('.', 1)[1]} = " not in text]
    assert not missing, f"deploy/kvpark.toml lacks {missing}"


def test_tenant_tables_resolve_validate_and_round_trip(tmp_path: Path) -> None:
    import hashlib

    digest = hashlib.sha256(b"s3cret").hexdigest()
    (tmp_path / "bob.token").write_text("  other-token\n")
    (tmp_path / "bob.token").chmod(0o600)  # the daemon refuses a token file others can read
    f = tmp_path / "t.toml"
    f.write_text(f'[tenants.alice]\ntoken_sha256 = "{digest.upper()}"\nquota = {{ host = "8MiB", disk = "1GiB" }}\n'
                 f'trusted_local = true\n\n[tenants.bob]\ntoken_file = "{tmp_path / "bob.token"}"\n')
    cfg = load(f, env={"KVPARK__TENANTS__BOB__TRUSTED_LOCAL": "true"})
    alice, bob = cfg.tenants["alice"], cfg.tenants["bob"]
    assert alice.token_sha256 == digest and alice.quota == {"host": 8 << 20, "disk": 1 << 30} and alice.trusted_local
    assert bob.token_sha256 == hashlib.sha256(b"other-token").hexdigest() and bob.quota == {} and bob.trusted_local
    text = to_toml(cfg)
    assert "other-token" not in text and "s3cret" not in text
    again = tmp_path / "again.toml"
    again.write_text(text)
    assert load(again, env={}) == cfg
    bad = [
        ({"tenants.a.token_sha256": digest, "tenants.a.token_file": str(f)}, "exactly one of"),
        ({"tenants.a.quota": {"host": "1GiB"}}, "exactly one of"),
        ({"tenants.a.token_sha256": "abc"}, "64 hex digits"),
        ({"tenants.a.token_sha256": digest, "tenants.a.qouta": {}}, "unknown key tenants.a.qouta"),
        ({"tenants.a.token_sha256": digest, "tenants.a.quota": {"gpu": "1GiB"}}, "unknown tier gpu"),
        ({"tenants.a.token_sha256": digest, "tenants.b.token_sha256": digest}, "same token as tenants.a"),
        ({"tenants.a.token_file": str(tmp_path / "missing")}, "cannot read"),
        ({"tenants.a b.token_sha256": digest}, "a tenant name is"),
        ({"server.tls_cert": "/x.pem"}, "set both"),
        ({"server.tls_client_ca": "/ca.pem"}, "need server.tls_cert"),
    ]
    for overrides, match in bad:
        with pytest.raises(ConfigError, match=match):
            load(env={}, overrides=overrides)


def _key_file(path: Path, text: str, mode: int = 0o600) -> Path:
    path.write_text(text)
    path.chmod(mode)
    return path


def test_the_private_tier_exists_only_for_tenants_that_are_not_trusted_local(tmp_path: Path) -> None:
    digest = "ab" * 32
    base = {"tiers.host.capacity": "64MiB", "tiers.host.shm_dir": ""}
    trusted = {"tenants.a.token_sha256": digest, "tenants.a.trusted_local": True}
    untrusted = {"tenants.b.token_sha256": "cd" * 32}
    # No tenants, or only trusted_local ones: no private tier, whatever its capacity says.
    assert load(env={}, overrides=base).tiers.private.capacity == 0
    assert load(env={}, overrides={**base, **trusted, "tiers.private.capacity": "8MiB"}).tiers.private.capacity == 0
    # A tenant that is not trusted_local: auto is a quarter of the host arena, in whole slots.
    cfg = load(env={}, overrides={**base, **trusted, **untrusted})
    assert cfg.untrusted == ("b",) and cfg.tiers.private.capacity == 16 << 20
    small = load(env={}, overrides={"tiers.host.capacity": "2MiB", "tiers.host.shm_dir": "", **untrusted})
    assert small.tiers.private.capacity == 1 << 20  # at least one slot
    odd = load(env={}, overrides={**base, **untrusted, "tiers.private.capacity": 5 * (1 << 20) + 123})
    assert odd.tiers.private.capacity == 5 << 20
    with pytest.raises(ConfigError, match="tiers.private.capacity: must hold at least one slot"):
        load(env={}, overrides={**base, **untrusted, "tiers.private.capacity": "64KiB"})
    with pytest.raises(ConfigError, match="tiers.private.low_watermark/high_watermark"):
        load(env={}, overrides={**base, **untrusted, "tiers.private.high_watermark": 0.5,
                                "tiers.private.low_watermark": 0.6})
    # The resolved tree reads back the same.
    again = tmp_path / "again.toml"
    again.write_text(to_toml(cfg))
    assert load(again, env={}) == cfg


def test_remote_key_files_resolve_into_the_remote_options(tmp_path: Path) -> None:
    cur, old = "ab" * 32, "CD" * 32
    kf = _key_file(tmp_path / "cur.key", cur + "\n")
    of = _key_file(tmp_path / "old.key", "  " + old)
    base = {"tiers.remote.url": "redis://127.0.0.1:1/0"}
    opts = load(env={}, overrides={**base, "tiers.remote.key_file": str(kf),
                                   "tiers.remote.old_key_files": [str(of)]}).remote_options
    assert opts is not None and opts.keys == (bytes.fromhex(cur), bytes.fromhex(old))
    env = {"KVPARK__TIERS__REMOTE__OLD_KEY_FILES": f"{of},{kf}"}  # comma-separated from the environment
    cfg = load(env=env, overrides={**base, "tiers.remote.key_file": str(kf)})
    assert cfg.tiers.remote.old_key_files == (str(of), str(kf))
    assert cfg.remote_options.keys == (bytes.fromhex(cur), bytes.fromhex(old))  # current first, once
    again = tmp_path / "cfg.toml"
    again.write_text(to_toml(cfg))
    assert load(again, env={}) == cfg
    assert load(env={}, overrides=base).remote_options.keys == ()  # no key: plain values


@pytest.mark.parametrize("case", ["missing", "short", "not hex", "raw bytes", "group", "others", "old bad",
                                  "old without key"])
def test_remote_key_files_that_are_unreadable_wrong_or_open_refuse(tmp_path: Path, case: str) -> None:
    good = _key_file(tmp_path / "good.key", "00" * 32)
    kv = {"tiers.remote.url": "redis://127.0.0.1:1/0", "tiers.remote.key_file": str(good)}
    want = "tiers.remote.key_file"
    if case == "missing":
        kv["tiers.remote.key_file"], want = str(tmp_path / "nope"), "cannot read"
    elif case == "short":
        kv["tiers.remote.key_file"], want = str(_key_file(tmp_path / "k", "00" * 31)), "64 hex digits"
    elif case == "not hex":
        kv["tiers.remote.key_file"], want = str(_key_file(tmp_path / "k", "zz" * 32)), "64 hex digits"
    elif case == "raw bytes":
        p = tmp_path / "k"
        p.write_bytes(os.urandom(32))
        p.chmod(0o600)
        kv["tiers.remote.key_file"], want = str(p), "64 hex digits"
    elif case in ("group", "others"):
        good.chmod(0o640 if case == "group" else 0o604)
        want = "open to group or others"
    elif case == "old bad":
        kv["tiers.remote.old_key_files"], want = [str(_key_file(tmp_path / "o", "11" * 32, 0o644))], \
            "old_key_files[0]"
    else:
        del kv["tiers.remote.key_file"]
        kv["tiers.remote.old_key_files"], want = [str(good)], "needs tiers.remote.key_file"
    with pytest.raises(ConfigError, match=want.replace("[", r"\[").replace("]", r"\]")):
        load(env={}, overrides=kv)
