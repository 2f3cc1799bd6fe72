"""The TLS and Redis password settings refuse what cannot work, naming the setting (and the file); `academus
up --tls`'s local CA signs certificates that name the loopback address, and nothing else can sign more."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from academus.shared.cli.pki import CLI, make_pki
from academus.shared.runtime.certificates import public_credentials
from academus.shared.runtime.config import CommonConfig, ConfigError, GatewayConfig, load
from academus.shared.runtime.redis_conn import redacted, with_password
from academus.shared.runtime.tls import MeshTls, read_pem

needs_openssl = pytest.mark.skipif(shutil.which("openssl") is None, reason="no `openssl` command")


@pytest.mark.parametrize(("cls", "env", "message"), [
    (GatewayConfig, {"ACADEMUS_TLS_CERT": "/c.pem"}, "ACADEMUS_TLS_KEY='' must be set together with ACADEMUS_TLS_CERT"),
    (GatewayConfig, {"ACADEMUS_TLS_KEY": "/k.pem"}, "ACADEMUS_TLS_KEY='/k.pem' must be set together with"),
    (GatewayConfig, {"ACADEMUS_TLS_CLIENT_CA": "/ca.pem"},
     "ACADEMUS_TLS_CLIENT_CA='/ca.pem' must be empty unless ACADEMUS_TLS_CERT is set"),
    (CommonConfig, {"ACADEMUS_MESH_TLS": "true"},
     "ACADEMUS_MESH_CA='' must be a PEM file's path when ACADEMUS_MESH_TLS is on"),
    (CommonConfig, {"ACADEMUS_MESH_TLS": "on", "ACADEMUS_MESH_CA": "/ca.pem", "ACADEMUS_MESH_CERT": "/c.pem"},
     "ACADEMUS_MESH_KEY='' must be"),
    (CommonConfig, {"ACADEMUS_MESH_TLS": "sometimes"}, "ACADEMUS_MESH_TLS='sometimes' is not a boolean"),
])
def test_tls_settings_that_cannot_work_are_refused_naming_the_variable(cls, env, message):
    with pytest.raises(ConfigError, match=message):
        load(cls, env)


def test_without_tls_settings_everything_is_plaintext():
    assert public_credentials(load(GatewayConfig, {})) is None
    assert MeshTls.from_config(load(CommonConfig, {})) is None


def test_an_unreadable_or_non_pem_file_is_named_with_its_setting(tmp_path):
    missing = tmp_path / "gone.pem"
    with pytest.raises(ConfigError, match=re.escape(f"ACADEMUS_TLS_CERT='{missing}': cannot read it (No such file")):
        read_pem("tls_cert", str(missing))
    (tmp_path / "plain.txt").write_text("not a certificate")
    with pytest.raises(ConfigError, match=re.escape(f"ACADEMUS_MESH_CA='{tmp_path / 'plain.txt'}': not a PEM file")):
        read_pem("mesh_ca", str(tmp_path / "plain.txt"))
    config = load(GatewayConfig, {"ACADEMUS_TLS_CERT": str(missing), "ACADEMUS_TLS_KEY": str(missing)})
    with pytest.raises(ConfigError, match="ACADEMUS_TLS_KEY="):   # read at start, before the port is bound
        public_credentials(config)


@pytest.mark.parametrize(("url", "password", "expected"), [
    ("redis://127.0.0.1:6379/0", "s3cret", "redis://:s3cret@127.0.0.1:6379/0"),
    ("redis://127.0.0.1:6379/0", "", "redis://127.0.0.1:6379/0"),
    ("redis://:own@10.0.0.1:6379/2", "other", "redis://:own@10.0.0.1:6379/2"),   # the URL's own wins
    ("redis://app@10.0.0.1:6379/0", "p@ss:/word", "redis://app:p%40ss%3A%2Fword@10.0.0.1:6379/0"),
])
def test_the_password_goes_into_a_url_that_holds_none(url, password, expected):
    assert with_password(url, password) == expected


def test_a_printed_url_hides_the_password():
    assert redacted("redis://:s3cret@127.0.0.1:6379/0") == "redis://:***@127.0.0.1:6379/0"
    assert redacted("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"


@needs_openssl
def test_the_local_ca_signs_certificates_for_the_loopback_address_and_is_gone(tmp_path):
    pki = make_pki(tmp_path, ["gateway", CLI])
    assert sorted(p.name for p in pki.directory.iterdir()) == ["ca.crt", "cli.crt", "cli.key", "gateway.crt",
                                                               "gateway.key"]   # no CA key left to sign more
    assert pki.directory.stat().st_mode & 0o077 == 0 and pki.key("gateway").stat().st_mode & 0o077 == 0
    verified = subprocess.run(["openssl", "verify", "-CAfile", str(pki.ca), "-verify_ip", "127.0.0.1",
                               str(pki.cert("gateway")), str(pki.cert(CLI))], capture_output=True, text=True)
    assert verified.returncode == 0, verified.stderr
    assert pki.service_env("gateway", mutual=False) == {"ACADEMUS_TLS_CERT": str(pki.cert("gateway")),
                                                        "ACADEMUS_TLS_KEY": str(pki.key("gateway"))}
    assert pki.service_env("worker", mutual=False) == {}
    assert pki.service_env("worker", mutual=True)["ACADEMUS_MESH_CERT"] == str(pki.cert("worker"))
