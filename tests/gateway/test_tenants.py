"""The tenant model without processes: the key file's formats and defaults, admission per tenant,
the priority cap, the cache namespace, and a config's ``api_keys`` type."""

from __future__ import annotations

import json

import pytest

from gateway.config import API_KEYS_ENV, GatewayConfig
from gateway.tenants import LOCAL_TENANT, Tenant, Tenants, load_tenants
from pagedserve.config import build_config, read_config_file
from pagedserve.errors import PermissionDeniedError, ResourceExhaustedError

TENANTS_JSON = {"tenants": {
    "team-a": {"keys": ["key-a-1", "key-a-2"], "max_priority": 5, "max_concurrent": 64},
    "team-b": {"keys": ["key-b"]},
}}


def _config(tmp_path, text: str, **fields: object) -> GatewayConfig:
    path = tmp_path / "keys"
    path.write_text(text)
    return GatewayConfig(backends=("h:1",), api_keys_file=str(path), **fields)


def test_json_tenants_file_with_operator_limits_and_defaults(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv(API_KEYS_ENV, raising=False)
    tenants = _config(tmp_path, json.dumps(TENANTS_JSON), max_queued_requests=100).tenants
    assert [(t.name, t.keys, t.max_priority, t.max_concurrent) for t in tenants] == [
        ("team-a", ("key-a-1", "key-a-2"), 5, 64),
        ("team-b", ("key-b",), 0, 50),  # defaults: priority 0, a fair share of 100 between 2 tenants
    ]
    assert "key-a" not in repr(tenants)  # keys never printed


def test_plain_keys_are_tenants_key_1_key_2_in_order(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(API_KEYS_ENV, "env-one,env-two")
    tenants = _config(tmp_path, "# comment\nfile-one\n\nfile-two\n", max_queued_requests=3).tenants
    assert [(t.name, t.keys, t.max_priority, t.max_concurrent) for t in tenants] == [
        ("key-1", ("env-one",), 0, 1), ("key-2", ("env-two",), 0, 1),
        ("key-3", ("file-one",), 0, 1), ("key-4", ("file-two",), 0, 1),  # max(1, 3 // 4)
    ]
    monkeypatch.delenv(API_KEYS_ENV)
    assert GatewayConfig(backends=("h:1",)).tenants == ()  # no key at all: local use


@pytest.mark.parametrize(("text", "named"), [
    ('{"tenants": {"a": {"keys": ["k1"]}, "b": {"keys": ["k1"]}}}', "a key of tenant 'b' is given twice"),
    ('{"tenants": {"a": {"keys": ["k1"], "max_concurent": 3}}}', "unknown field"),
    ('{"tenants": {"a": {"keys": "k1"}}}', "keys must be a non-empty list"),
    ('{"tenants": {"a": {"keys": ["k1"], "max_priority": "5"}}}', "max_priority must be an integer"),
    ('{"tenants": {"a": {"keys": ["k1"], "max_concurrent": 0}}}', "max_concurrent must be >= 1"),
    ('{"tenants": {"a b": {"keys": ["k1"]}}}', "tenant name 'a b'"),
    ('{"tenants": {"a": {"keys": ["has space"]}}}', "printable ASCII characters without spaces"),
    ('{"tenants": {}}', "names no tenant"),
    ('{"keys": ["k1"]}', 'must be {"tenants"'),
    ('{"tenants": ', "not valid JSON"),
])
def test_bad_tenants_files_name_the_problem_never_the_key(tmp_path, monkeypatch, text: str, named: str) -> None:
    monkeypatch.delenv(API_KEYS_ENV, raising=False)
    with pytest.raises(ValueError, match="api_keys_file") as info:
        _config(tmp_path, text)
    assert named in str(info.value) and "k1" not in str(info.value).replace("'k1'", "")


def test_a_plain_key_named_like_a_json_tenant_is_refused() -> None:
    with pytest.raises(ValueError, match="tenant 'key-1' is named twice"):
        load_tenants(["plain"], '{"tenants": {"key-1": {"keys": ["other"]}}}', "f", 8)


def test_api_keys_string_in_a_json_config_is_an_error_not_one_key_per_character(tmp_path, monkeypatch) -> None:
    """``"api_keys": "supersecret"`` used to authorize ``Bearer s``."""
    monkeypatch.delenv(API_KEYS_ENV, raising=False)
    path = tmp_path / "gateway.json"
    path.write_text(json.dumps({"backends": ["h:1"], "api_keys": "supersecret"}))
    with pytest.raises(ValueError, match="api_keys must be a list of strings, got str"):
        build_config(GatewayConfig, read_config_file(path), {})
    path.write_text(json.dumps({"backends": ["h:1"], "api_keys": ["supersecret"]}))
    [tenant] = build_config(GatewayConfig, read_config_file(path), {}).tenants
    assert tenant.keys == ("supersecret",)
    registry = Tenants([tenant], 8)
    assert registry.identify(b"s") is None and registry.identify(b"supersecret") is tenant


def test_per_tenant_admission_names_the_limit_and_releases_once() -> None:
    """One tenant at its max_concurrent leaves the others their slots."""
    seen: list[tuple[str, int]] = []
    a, b = Tenant("team-a", max_concurrent=2, keys=("ka",)), Tenant("team-b", max_concurrent=2, keys=("kb",))
    tenants = Tenants([a, b], max_in_flight=3, on_change=lambda name, n: seen.append((name, n)))
    first, second = tenants.admit(a), tenants.admit(a)
    with pytest.raises(ResourceExhaustedError, match=r"tenant 'team-a' holds 2 requests, its max_concurrent \(2\)"):
        tenants.admit(a)
    third = tenants.admit(b)
    with pytest.raises(ResourceExhaustedError, match=r"the gateway holds 3 requests \(max_queued_requests\)"):
        tenants.admit(b)
    first.release()
    first.release()  # idempotent: every exit path may call it
    assert tenants.num_active == {"team-a": 1, "team-b": 1} and tenants.num_in_flight == 2
    with tenants.admit(a):
        assert tenants.num_active["team-a"] == 2
    second.release()
    third.release()
    assert tenants.num_active == {"team-a": 0, "team-b": 0} and tenants.num_in_flight == 0
    assert seen == [("team-a", 1), ("team-a", 2), ("team-b", 1), ("team-a", 1), ("team-a", 2), ("team-a", 1),
                    ("team-a", 0), ("team-b", 0)]


def test_one_tenant_cannot_fill_the_gateway() -> None:
    """A tenant whose max_concurrent reaches the gateway's whole queue still holds
    at most 3/4 of it when there are other tenants, so a newcomer gets in; a tenant alone may hold it
    all. Before: a took all 8 and b was refused (the gateway holds 8 requests)."""
    a, b = Tenant("team-a", max_concurrent=100, keys=("ka",)), Tenant("team-b", keys=("kb",))
    tenants = Tenants([a, b], max_in_flight=8)
    held = [tenants.admit(a) for _ in range(6)]
    with pytest.raises(ResourceExhaustedError, match=r"tenant 'team-a' holds 6 requests, its share of the gateway "
                                                     r"\(3/4 of max_queued_requests: 6\)"):
        tenants.admit(a)
    held += [tenants.admit(b), tenants.admit(b)]
    assert tenants.num_in_flight == 8
    alone = Tenants([a], max_in_flight=8)
    assert len([alone.admit(a) for _ in range(8)]) == 8


def test_priority_above_the_tenants_maximum_is_permission_denied() -> None:
    """Refused, never clamped; the local tenant (no keys) has no cap."""
    keyed = Tenant("team-b", keys=("kb",))  # max_priority defaults to 0
    keyed.check_priority(0)
    keyed.check_priority(-3)
    with pytest.raises(PermissionDeniedError, match=r"priority 1 is above the max_priority of tenant .team-b. \(0\)"):
        keyed.check_priority(1)
    Tenant("team-a", max_priority=5).check_priority(5)
    with pytest.raises(PermissionDeniedError):
        Tenant("team-a", max_priority=5).check_priority(2147483647)
    local = Tenants([], 8).identify(None)
    assert local.name == LOCAL_TENANT and local.max_concurrent is None
    local.check_priority(2147483647)


def test_cache_namespace_is_the_tenants_narrowed_by_the_clients_salt() -> None:
    """No client salt of one tenant names another tenant's namespace."""
    a, b = Tenant("team-a"), Tenant("team-b")
    assert a.cache_salt("") == a.cache_salt("")
    assert len({a.cache_salt(""), b.cache_salt(""), a.cache_salt("x"), b.cache_salt("x")}) == 4
    assert a.cache_salt("x") != a.cache_salt("")
    assert all(len(t.cache_salt("s" * 256)) <= 256 and "team" not in t.cache_salt("") for t in (a, b))


def test_the_cache_namespace_is_bound_to_the_key_not_its_position_or_name() -> None:
    """A new key listed first (named key-1, as the revoked key before it) read the
    old tenant's cached prompts; the namespace now derives from the key itself."""
    [old] = load_tenants(["old-secret"], None, "env", 8)
    new, kept = load_tenants(["new-secret", "old-secret"], None, "env", 8)
    assert old.name == new.name == "key-1" and kept.name == "key-2"
    assert new.cache_salt("") != old.cache_salt("") and kept.cache_salt("") == old.cache_salt("")
    # A tenants file's explicit name stays, its namespace still the key's; no key shows in it.
    named = Tenant("team-a", keys=("old-secret",))
    assert named.cache_salt("x") == kept.cache_salt("x") != Tenant("team-a", keys=("other",)).cache_salt("x")
    assert "secret" not in named.namespace and "team" not in named.namespace
    assert Tenant("local").namespace == "local"


def test_a_batch_is_admitted_all_or_none() -> None:
    """An HTTP prompt list takes every slot it needs at once, or none."""
    from pagedserve.errors import ResourceExhaustedError

    small = Tenant("small", max_concurrent=3)
    tenants = Tenants([small, Tenant("other")], 5)
    with pytest.raises(ResourceExhaustedError, match=r"holds 0 requests, its max_concurrent \(3\) and this request "
                                                     r"asks for 4 more"):
        tenants.admit_many(small, 4)
    assert (tenants.num_in_flight, tenants.num_active["small"]) == (0, 0)
    held = tenants.admit_many(small, 3)
    with pytest.raises(ResourceExhaustedError, match="the gateway holds 3 requests"):
        tenants.admit_many(Tenant("other"), 3)
    for admission in held + held:  # release is idempotent
        admission.release()
    assert (tenants.num_in_flight, tenants.num_active["small"]) == (0, 0)


def test_a_tenants_request_rate_is_a_bucket_of_a_seconds_worth() -> None:
    """max_requests_per_s 2: two requests at once, then one more each half second; a tenant without
    the field is never charged; the refusal says when to retry."""
    now = [100.0]
    limited = Tenant("team-r", 0, None, ("rate-key-0123456789",), max_requests_per_s=2)
    free = Tenant("team-f", 0, None, ("free-key-0123456789",))
    tenants = Tenants([limited, free], 16, clock=lambda: now[0])
    tenants.charge(limited)
    tenants.charge(limited)
    with pytest.raises(ResourceExhaustedError, match=r"^tenant 'team-r' sends more than its max_requests_per_s "
                                                     r"\(2 a second\); retry in 0\.50 s$"):
        tenants.charge(limited)
    now[0] += 0.5
    tenants.charge(limited)
    with pytest.raises(ResourceExhaustedError, match="retry in 0.50 s"):
        tenants.charge(limited)
    now[0] += 10.0  # idle: back to a second's worth, no more
    tenants.charge(limited)
    tenants.charge(limited)
    with pytest.raises(ResourceExhaustedError):
        tenants.charge(limited)
    for _ in range(100):
        tenants.charge(free)


def test_a_tenants_file_sets_its_request_rate(tmp_path, monkeypatch) -> None:
    text = json.dumps({"tenants": {"team-r": {"keys": ["rate-key-0123456789"], "max_requests_per_s": 0.5}}})
    [tenant] = load_tenants([], text, "keys.json", 8)
    assert tenant.max_requests_per_s == 0.5
    for bad, named in ((0, "must be > 0"), ("5", "must be a number"), (True, "must be a number")):
        text = json.dumps({"tenants": {"team-r": {"keys": ["rate-key-0123456789"], "max_requests_per_s": bad}}})
        with pytest.raises(ValueError, match=f"team-r.*max_requests_per_s {named}"):
            load_tenants([], text, "keys.json", 8)
