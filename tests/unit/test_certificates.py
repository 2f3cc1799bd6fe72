"""A server's TLS files followed: a whole new set is taken, a half-written one is not, files are looked at at most
once a LOOK_S."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from academus.shared.cli.pki import Pki, make_pki
from academus.shared.runtime.certificates import LOOK_S, ServerCertificates
from academus.shared.runtime.config import ConfigError

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="no `openssl` command")


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def two(tmp_path_factory) -> tuple[Pki, Pki]:
    return make_pki(tmp_path_factory.mktemp("a"), ["gateway"]), make_pki(tmp_path_factory.mktemp("b"), ["gateway"])


def install(pki: Pki, live: Path, *names: str) -> None:
    for name in names or ("gateway.key", "gateway.crt"):
        shutil.copy(pki.directory / name, live / name)


def test_a_whole_new_set_is_taken_once_and_a_half_written_one_is_not(two, tmp_path):
    old, new = two
    install(old, tmp_path)
    clock = Clock()
    certificates = ServerCertificates(("tls_key", str(tmp_path / "gateway.key")),
                                      ("tls_cert", str(tmp_path / "gateway.crt")), clock=clock)
    assert certificates.cert == old.cert("gateway").read_bytes()
    install(new, tmp_path, "gateway.key")   # the key rotated, its certificate not yet
    clock.now += LOOK_S
    assert certificates.reload() is False and certificates.cert == old.cert("gateway").read_bytes()
    install(new, tmp_path, "gateway.crt")
    clock.now += LOOK_S / 2
    assert certificates.reload() is False   # not looked at again within LOOK_S
    clock.now += LOOK_S / 2
    assert certificates.reload() is True
    assert (certificates.key, certificates.cert) == (new.key("gateway").read_bytes(), new.cert("gateway").read_bytes())
    assert certificates.reloads == 1
    clock.now += LOOK_S
    assert certificates.reload() is False   # unchanged since


def test_a_file_gone_mid_rotation_keeps_the_old_set(two, tmp_path):
    old, _ = two
    install(old, tmp_path)
    clock = Clock()
    certificates = ServerCertificates(("tls_key", str(tmp_path / "gateway.key")),
                                      ("tls_cert", str(tmp_path / "gateway.crt")), clock=clock)
    (tmp_path / "gateway.crt").unlink()
    clock.now += LOOK_S
    assert certificates.reload() is False and certificates.cert == old.cert("gateway").read_bytes()
    install(old, tmp_path, "gateway.crt")   # back: a new stamp, the same whole set
    clock.now += LOOK_S
    assert certificates.reload() is True


def test_a_key_that_is_not_the_certificates_stops_the_start_naming_both(two, tmp_path):
    old, new = two
    install(old, tmp_path, "gateway.crt")
    install(new, tmp_path, "gateway.key")
    with pytest.raises(ConfigError, match=r"ACADEMUS_TLS_KEY=.* is not the key of ACADEMUS_TLS_CERT="):
        ServerCertificates(("tls_key", str(tmp_path / "gateway.key")), ("tls_cert", str(tmp_path / "gateway.crt")))
