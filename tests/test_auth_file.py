"""The tenants file: what is not plainly a key, a digest, a tenant or a finite limit is refused
at start-up with the tenant and the field named (never a key made of a YAML null or a number
by accident, never a tenant defined twice)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kdn.errors import ConfigError
from kdn.server.auth import digest, load_auth, tenants_from_text

DIGEST = "sha256:" + digest("secret-a")


def _load(tmp_path: Path, text: str) -> object:
    f = tmp_path / "tenants.yaml"
    f.write_text(text)
    f.chmod(0o600)
    return load_auth(f)


@pytest.mark.parametrize("text,why", [
    ("tenants:\n  ops:\n    role: admin\n    api_keys:\n      -\n",
     r"tenant 'ops': api_keys\[0\] must be a non-empty string .* got null"),
    ("tenants:\n  a: {api_keys: [012345]}\n", r"api_keys\[0\] must be a non-empty string"),
    ("tenants:\n  a: {api_keys: ['']}\n", r"api_keys\[0\] must be a non-empty string"),
    ("tenants:\n  a: {api_keys: ['sha256:xyz']}\n", r"api_keys\[0\]: malformed"),
    ("tenants:\n  a: {api_keys: [k1]}\n  b: {api_keys: [k2]}\n  a: {api_keys: [k3], "
     "role: admin}\n", r"'a' is defined twice"),
    ("tenants:\n  a: {api_keys: [k1], rate_rps: .nan}\n", r"rate_rps: must be a finite"),
    ("tenants:\n  a: {api_keys: [k1], rate_rps: -5}\n", r"rate_rps: must be a finite"),
    ("tenants:\n  a: {api_keys: [k1], burst: 2.9}\n", r"burst: must be a finite whole"),
    ("tenants:\n  a: {api_keys: [k1], burst: 2}\n", r"tenant 'a': burst needs rate_rps"),
    ("tenants:\n  a: {api_keys: [k1], quota_bytes: -1}\n", r"quota_bytes: must be"),
    ("tenants:\n  a: {api_keys: [k1], quota_bytes: true}\n", r"quota_bytes: a number"),
    ("tenants:\n  a: {api_keys: [k1]}\nadmins: [a]\n", r"unknown settings \['admins'\]"),
    ("tenants:\n  a: {api_keys: [\u043a\u043b\u044e\u0447]}\n", r"api_keys\[0\] must be "
     "printable ASCII"),  # no client can send it
    ("tenants:\n  a: {api_keys: ['key-a ']}\n", r"api_keys\[0\] must be printable ASCII "
     "with no leading or trailing whitespace"),  # kdn's client never sends it
    ("tenants:\n  a: {api_keys: [' key-a']}\n", r"no leading or trailing whitespace"),
    # an OverflowError traceback; and a quota past 2**64 started, then broke every Stats
    ("tenants:\n  a: {api_keys: [k1], burst: 1" + "0" * 400 + "}\n", r"burst: "),
    ("tenants:\n  a: {api_keys: [k1], quota_bytes: 100000000TiB}\n", r"quota_bytes: at most"),
    ("tenants:\n  a: {api_keys: [k1], quota_bytes: 1" + "0" * 30 + "}\n", r"quota_bytes: at"),
])
def test_odd_tenants_files_are_refused_naming_the_field(tmp_path: Path, text: str,
                                                        why: str) -> None:
    with pytest.raises(ConfigError, match=why):
        _load(tmp_path, text)


def test_merge_keys_share_settings_and_a_key_named_twice_is_still_refused(
        tmp_path: Path) -> None:
    """YAML merge keys (``<<: *anchor``) load as ``yaml.safe_load`` reads them, the keys a
    tenant names itself winning (they were refused as a tag no constructor knows); a key a
    mapping names twice itself is refused as before, also beside a merge key, and also in a
    mapping merged into another before its own turn came."""
    cfg = _load(tmp_path, "tenants:\n  a: &limits {api_keys: [k1], rate_rps: 100, burst: 200}\n"
                          "  b:\n    <<: *limits\n    api_keys: [k2]\n    burst: 300\n")
    policies = cfg.policies  # type: ignore[attr-defined]
    assert (policies["a"].rate_rps, policies["a"].burst) == (100, 200)
    assert (policies["b"].rate_rps, policies["b"].burst) == (100, 300)
    from kdn.yamlfiles import parse_yaml
    assert parse_yaml("x: &x {p: 1}\nl:\n  m: &y {<<: *x, q: 2}\ne: {<<: *y, r: 3}\n")[
        "e"] == {"p": 1, "q": 2, "r": 3}
    with pytest.raises(ConfigError, match="'burst' is defined twice"):
        _load(tmp_path, "tenants:\n  a: &limits {api_keys: [k1], rate_rps: 100}\n"
                        "  b: {<<: *limits, api_keys: [k2], burst: 1, burst: 2}\n")


def test_a_plain_file_loads_as_written(tmp_path: Path) -> None:
    cfg = _load(tmp_path, f"tenants:\n  a: {{api_keys: ['k-1'], rate_rps: 2.5, burst: 4, "
                          f"quota_bytes: 1GiB, egress_bytes_per_s: 125MB}}\n"
                          f"  b: {{api_keys: ['sha256:{DIGEST[7:].upper()}'], role: admin}}\n")
    assert cfg.keys[digest("k-1")][0] == "a"  # type: ignore[attr-defined]
    assert cfg.keys[DIGEST[7:]][0] == "b"  # type: ignore[attr-defined]  # any case
    policy = cfg.policies["a"]  # type: ignore[attr-defined]
    assert (policy.rate_rps, policy.burst, policy.quota_bytes, policy.egress_bytes_per_s) \
        == (2.5, 4, 1 << 30, 125_000_000)


@pytest.mark.parametrize("text,why", [
    ('tenants:\n  a: {api_keys: ["s3cr3t-key-a"], rate_rps: 50\n  b: {api_keys: ["s3cr3t-b"]}\n',
     r"not valid YAML: .*expected ',' or '}', but got ':' at line 3, column 4$"),
    ('tenants:\n  a: {api_keys: ["s3cr3t-key-a" ,, ]}\n',
     r"not valid YAML: .*found ',' at line 2, column 34$"),
    ("tenants:\n  a: {api_keys: [98127361823761]}\n", r"api_keys\[0\] .* got a number$"),
    # a tag the value does not fit, and a date that is none: PyYAML raised int()'s ValueError,
    # quoting the key, in a traceback; nesting past Python's recursion limit: RecursionError
    ("tenants:\n  a: {api_keys: [!!int s3cr3t-key-a]}\n",
     r"not valid YAML: a value YAML can not read as !!int .* at line 2, column 18$"),
    ("tenants:\n  a: {api_keys: ['s3cr3t'], rate_rps: !!float s3cr3t}\n", r"as !!float"),
    ("tenants:\n  a: {api_keys: [!!bool s3cr3t]}\n", r"as !!bool"),
    ("tenants:\n  a: {api_keys: [2024-02-30]}\n", r"as !!timestamp .* quote it"),
    # an empty value under a tag: PyYAML's IndexError
    ("tenants:\n  a: {api_keys: ['s3cr3t'], rate_rps: !!float ''}\n", r"as !!float"),
    ("tenants:\n  a: {api_keys: ['s3cr3t'], burst: !!int ''}\n", r"as !!int"),
    ("tenants: " + "[" * 3000 + "]" * 3000 + "\n", r"not valid YAML: nested too deeply$"),
])
def test_errors_about_a_tenants_file_never_quote_its_keys(tmp_path: Path, text: str,
                                                           why: str) -> None:
    """PyYAML's message quotes the lines around a problem, and a key written as a number was
    echoed: the message says what and where, and leaves the keys out (a tenants file, and
    the same text as auth_tenants)."""
    for load in (lambda: _load(tmp_path, text), lambda: tenants_from_text(text)):
        with pytest.raises(ConfigError, match=why) as err:
            load()
        assert "s3cr3t" not in str(err.value) and "98127361823761" not in str(err.value)


def test_auth_tenants_text_refuses_what_a_tenants_file_refuses() -> None:
    """The same text as auth_tenants (KDN_AUTH_TENANTS) and as --auth-file: a misspelt second
    section ('tenant:' holding the admin) was dropped silently from the former."""
    text = (f'tenants:\n  a: {{api_keys: ["{DIGEST}"]}}\n'
            f'tenant:\n  ops: {{api_keys: ["sha256:{digest("k2")}"], role: admin}}\n')
    with pytest.raises(ConfigError, match=r"auth_tenants: unknown settings \['tenant'\] "
                                          r"\(only 'tenants'\)"):
        tenants_from_text(text)
    assert sorted(tenants_from_text(text.split("tenant:\n")[0]).policies) == ["a"]
