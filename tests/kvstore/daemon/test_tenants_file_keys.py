"""A tenants file that names a key twice or has an unknown top-level key is refused at start
with one line naming the key: YAML and JSON kept the last of two same-named tenants silently
(a reader's token vanished and the name became admin), and a misspelt or extra top-level key
(``tennants:``) was ignored."""
from __future__ import annotations

import re

import pytest

from kvstore.daemon import cli
from kvstore.daemon.tenants import TenantTable

R, W, A = "reader-token-0123456789", "writer-token-0123456789", "admin-token-01234567890"


@pytest.mark.parametrize("name, text, msg", [
    # the same tenant twice: a reader, then an admin under its name
    ("t.yaml", f"tenants:\n  dash: {{token: {R}, role: reader, salt: alice}}\n"
               f"  dash: {{token: {A}, role: admin}}\n",
     "ConstructorError at line 3, column 3: found duplicate key 'dash'"),
    ("t.yml", f"tenants:\n  alice:\n    token: {W}\n    role: tenant\n    role: admin\n",
     "ConstructorError at line 5, column 5: found duplicate key 'role'"),
    ("t.json", f'{{"tenants": {{"dash": {{"token": "{R}", "role": "reader"}}, '
               f'"dash": {{"token": "{A}", "role": "admin"}}}}}}',
     "duplicate key 'dash'"),
    ("t.json", f'{{"tenants": {{"a": {{"token": "{W}", "token": "{A}"}}}}}}',
     "duplicate key 'token'"),
    ("t.json", f'{{"tenants": {{"a": {{"token": "{W}"}}}}, "tenants": {{}}}}',
     "duplicate key 'tenants'"),
])
def test_a_key_twice_is_refused_naming_it_and_never_a_token(tmp_path, name, text, msg):
    p = tmp_path / name
    p.write_text(text)
    with pytest.raises(ValueError) as e:
        TenantTable.from_file(p)
    assert str(e.value) == f"malformed tenants file {p}: {msg}"
    assert "0123456789" not in str(e.value)


@pytest.mark.parametrize("text, msg", [
    (f"tenants:\n  a: {{token: {W}}}\ntennants:\n  b: {{token: {R}, role: reader}}\n",
     "unknown top-level key 'tennants'; the file holds only 'tenants:'"),
    (f"tenants:\n  a: {{token: {W}}}\nadmins: [ops]\n",
     "unknown top-level key 'admins'; the file holds only 'tenants:'"),
    (f"tennants:\n  a: {{token: {W}}}\n", "unknown top-level key 'tennants'; did you mean "
                                          "'tenants'?"),
    (f"Tenants:\n  a: {{token: {W}}}\n", "unknown top-level key 'Tenants'; did you mean "
                                         "'tenants'?"),
])
def test_an_unknown_top_level_key_is_refused(tmp_path, text, msg):
    p = tmp_path / "t.yaml"
    p.write_text(text)
    with pytest.raises(ValueError, match=re.escape(msg)):
        TenantTable.from_file(p)


def test_distinct_keys_and_the_inner_mapping_still_read(tmp_path):
    p = tmp_path / "t.json"
    p.write_text(f'{{"tenants": {{"a": {{"token": "{W}"}}, "b": {{"token": "{R}", '
                 f'"role": "reader", "salt": "a"}}}}}}')
    assert [(t.name, t.role, t.salt) for t in TenantTable.from_file(p).tenants] == [
        ("a", "tenant", "a"), ("b", "reader", "a")]
    q = tmp_path / "t.yaml"  # the inner mapping alone (no 'tenants:'), tenants named like it
    q.write_text(f"tenant: {{token: {W}}}\ntenants2: {{token: {R}}}\n")
    assert [t.name for t in TenantTable.from_file(q).tenants] == ["tenant", "tenants2"]


def test_kvstore_serve_refuses_a_duplicate_tenant_in_one_line_exit_2(tmp_path, capsys):
    p = tmp_path / "t.yaml"
    p.write_text(f"tenants:\n  dash: {{token: {R}, role: reader}}\n"
                 f"  dash: {{token: {A}, role: admin}}\n")
    assert cli.main(["serve", "--port", "0", "--cpu-bytes", "1MiB",
                     "--tenants-file", str(p)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "found duplicate key 'dash'" in err, err


def test_yaml_merge_keys_may_be_overridden(tmp_path):
    """YAML's merge key (``<<: *base``) shares fields between tenants; a key given beside it
    overrides the merged one (no duplicate), while a key twice in the mapping itself is."""
    p = tmp_path / "t.yaml"
    p.write_text(f"tenants:\n  alice: &base {{token: {R}, role: reader, salt: team}}\n"
                 f"  bob: {{<<: *base, token: {W}}}\n")
    assert [(t.name, t.role, t.salt) for t in TenantTable.from_file(p).tenants] == [
        ("alice", "reader", "team"), ("bob", "reader", "team")]
    p.write_text(f"tenants:\n  alice: &base {{token: {R}, role: reader}}\n"
                 f"  bob: {{<<: *base, token: {W}, role: tenant, role: admin}}\n")
    with pytest.raises(ValueError, match="found duplicate key 'role'"):
        TenantTable.from_file(p)
