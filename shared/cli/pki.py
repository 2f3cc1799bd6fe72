"""`academus up --tls`: a local CA and the certificates the mesh needs, made with the `openssl` command in
<run dir>/tls (mode 0700): the gateway's for its public port and, with mutual TLS, one for each service and
one for the command line (its health checks, `academus tenants`). Each names 127.0.0.1 and localhost, where
the local mesh's services listen and dial, and serves both ends of a connection. The CA's key is deleted
once they are signed: nothing can join the mesh later, and `academus up` makes a new CA each time."""

from __future__ import annotations

import ipaddress
import secrets
import shutil
import subprocess
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

TLS_DIR = "tls"
CLI = "cli"              # the command line's own certificate
DAYS = 90
SUBJECT_NAMES = "IP:127.0.0.1,DNS:localhost"
EC_KEY = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]


class PkiError(RuntimeError):
    pass


@dataclass(frozen=True)
class Pki:
    directory: Path

    @property
    def ca(self) -> Path:
        return self.directory / "ca.crt"

    def cert(self, name: str) -> Path:
        return self.directory / f"{name}.crt"

    def key(self, name: str) -> Path:
        return self.directory / f"{name}.key"

    def service_env(self, service: str, mutual: bool) -> dict[str, str]:
        """The settings that give `service` its certificate: the gateway's public port's, and the mesh's."""
        env = {"ACADEMUS_TLS_CERT": str(self.cert(service)), "ACADEMUS_TLS_KEY": str(self.key(service))} \
            if service == "gateway" else {}
        if mutual:
            env |= {"ACADEMUS_MESH_TLS": "true", "ACADEMUS_MESH_CA": str(self.ca),
                    "ACADEMUS_MESH_CERT": str(self.cert(service)), "ACADEMUS_MESH_KEY": str(self.key(service))}
        return env


def make_pki(run_dir: Path, names: Iterable[str]) -> Pki:
    """A new CA in <run_dir>/tls and a certificate for each of `names`, signed by it, each naming the loopback
    addresses; the CA's key is deleted."""
    return issue(run_dir / TLS_DIR, {name: SUBJECT_NAMES for name in names})


def issue(directory: Path, leaves: Mapping[str, str], keep_ca_key: bool = False) -> Pki:
    """A new CA in `directory` (mode 0700) and, for each leaf name, a key and a certificate it signed whose
    subjectAltName is the leaf's value ("DNS:a,IP:10.0.0.1"), good for both ends of a connection.
    `keep_ca_key`: ca.key stays (0600), to sign more later; else it is deleted once the leaves are signed."""
    pki = Pki(directory)
    pki.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    pki.directory.chmod(0o700)
    ca_key = pki.key("ca")
    _openssl("req", "-x509", *EC_KEY, "-days", str(DAYS), "-subj", "/CN=academus local CA",
             "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign",
             "-keyout", str(ca_key), "-out", str(pki.ca))
    ca_key.chmod(0o600)
    extensions = pki.directory / "leaf.ext"
    try:
        for name, subject_names in leaves.items():
            extensions.write_text(f"subjectAltName={subject_names}\nbasicConstraints=CA:FALSE\n"
                                  "keyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth,clientAuth\n")
            request = pki.directory / f"{name}.csr"
            _openssl("req", "-new", *EC_KEY, "-subj", f"/CN={name}", "-keyout", str(pki.key(name)),
                     "-out", str(request))
            _openssl("x509", "-req", "-in", str(request), "-CA", str(pki.ca), "-CAkey", str(ca_key),
                     "-set_serial", str(secrets.randbits(63)), "-days", str(DAYS), "-extfile", str(extensions),
                     "-out", str(pki.cert(name)))
            request.unlink()
            pki.key(name).chmod(0o600)
    finally:
        extensions.unlink(missing_ok=True)
        if not keep_ca_key:
            ca_key.unlink(missing_ok=True)
    return pki


def subject_names(names: Iterable[str]) -> str:
    """openssl's subjectAltName value for host names and IP addresses: "DNS:a,IP:10.0.0.1"."""
    out = []
    for name in names:
        ip = _is_ip(name)
        if not name or "," in name or (":" in name and not ip):
            raise ValueError(f"{name!r} is not a host name or an IP address")
        out.append(f"IP:{name}" if ip else f"DNS:{name}")
    return ",".join(out)


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def _openssl(*args: str) -> None:
    binary = shutil.which("openssl")
    if binary is None:
        raise PkiError("`academus up --tls` makes its certificates with the `openssl` command, which is not on PATH")
    done = subprocess.run([binary, *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise PkiError(f"openssl {args[0]} failed: {done.stderr.strip()[-500:]}")
