"""Throw-away PKI for the local control plane.

Everything is ECDSA P-256: key generation is ~1000x faster than RSA-2048,
which keeps ``up`` fast, and every component (etcd is plain HTTP here;
kube-apiserver, controller-manager, scheduler, kwok, kubectl, Python's ssl)
accepts it, including ES256 for service-account tokens.

Certificates are valid for a year; a state dir is recreated on every ``up``,
so nothing is ever renewed.
"""

from __future__ import annotations

import datetime as _dt
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

__all__ = ["FRONT_PROXY_CLIENT", "PKI", "generate_pki"]

#: CN of the aggregation-layer client cert (``--requestheader-allowed-names``).
FRONT_PROXY_CLIENT = "front-proxy-client"

_VALIDITY = _dt.timedelta(days=365)
# Clock skew between this process and the apiserver is zero (same host), but
# back-date a little anyway so a cert is never "not yet valid" by a second.
_BACKDATE = _dt.timedelta(minutes=5)


@dataclass(frozen=True)
class PKI:
    """Paths of every PEM file the cluster components use."""

    dir: Path
    ca_cert: Path
    ca_key: Path
    apiserver_cert: Path
    apiserver_key: Path
    admin_cert: Path
    admin_key: Path
    sa_key: Path
    sa_pub: Path
    front_proxy_ca_cert: Path
    front_proxy_ca_key: Path
    front_proxy_client_cert: Path
    front_proxy_client_key: Path

    @classmethod
    def at(cls, directory: Path) -> PKI:
        """Return the PKI layout rooted at ``directory`` (files may not exist yet)."""
        return cls(
            dir=directory,
            ca_cert=directory / "ca.crt",
            ca_key=directory / "ca.key",
            apiserver_cert=directory / "apiserver.crt",
            apiserver_key=directory / "apiserver.key",
            admin_cert=directory / "admin.crt",
            admin_key=directory / "admin.key",
            sa_key=directory / "sa.key",
            sa_pub=directory / "sa.pub",
            front_proxy_ca_cert=directory / "front-proxy-ca.crt",
            front_proxy_ca_key=directory / "front-proxy-ca.key",
            front_proxy_client_cert=directory / "front-proxy-client.crt",
            front_proxy_client_key=directory / "front-proxy-client.key",
        )

    def exists(self) -> bool:
        """True when every file of the layout is present."""
        return all(
            p.is_file()
            for p in (
                self.ca_cert,
                self.ca_key,
                self.apiserver_cert,
                self.apiserver_key,
                self.admin_cert,
                self.admin_key,
                self.sa_key,
                self.sa_pub,
                self.front_proxy_ca_cert,
                self.front_proxy_ca_key,
                self.front_proxy_client_cert,
                self.front_proxy_client_key,
            )
        )


def _new_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    path.write_bytes(pem)
    path.chmod(0o600)


def _write_cert(path: Path, cert: x509.Certificate) -> None:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def _name(cn: str, org: str | None = None) -> x509.Name:
    attrs = [x509.NameAttribute(NameOID.COMMON_NAME, cn)]
    if org is not None:
        attrs.append(x509.NameAttribute(NameOID.ORGANIZATION_NAME, org))
    return x509.Name(attrs)


def _builder(
    subject: x509.Name, issuer: x509.Name, key: ec.EllipticCurvePrivateKey, *, ca: bool
) -> x509.CertificateBuilder:
    """The part a CA's and a leaf's certificate share: ``key``'s, valid from a little before now; a CA's
    key signs certificates and CRLs, a leaf's only signs (its handshakes)."""
    now = _dt.datetime.now(_dt.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _BACKDATE)
        .not_valid_after(now + _VALIDITY)
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=ca,
                crl_sign=ca,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
    )


def _issue(
    key_path: Path,
    cert_path: Path,
    *,
    subject: x509.Name,
    ca_cert: x509.Certificate,
    ca_key: ec.EllipticCurvePrivateKey,
    server_names: list[str] | None = None,
    server_ips: list[str] | None = None,
    client: bool = False,
) -> None:
    """A new key, and a certificate for it that the CA signs, written to ``key_path`` and ``cert_path``."""
    key = _new_key()
    usages = []
    if server_names or server_ips:
        usages.append(ExtendedKeyUsageOID.SERVER_AUTH)
    if client:
        usages.append(ExtendedKeyUsageOID.CLIENT_AUTH)
    builder = (
        _builder(subject, ca_cert.subject, key, ca=False)
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
            critical=False,
        )
    )
    sans: list[x509.GeneralName] = [x509.DNSName(n) for n in server_names or []]
    sans += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in server_ips or []]
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    _write_key(key_path, key)
    _write_cert(cert_path, builder.sign(ca_key, hashes.SHA256()))


def _new_ca(cn: str, key_path: Path, cert_path: Path) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    """A new self-signed CA named ``cn``, written to ``key_path`` and ``cert_path``; returns its key and cert."""
    key = _new_key()
    subject = _name(cn)
    cert = (
        _builder(subject, subject, key, ca=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    _write_key(key_path, key)
    _write_cert(cert_path, cert)
    return key, cert


def generate_pki(directory: Path, *, service_ip: str) -> PKI:
    """Create a CA, apiserver serving cert, admin client cert and SA key pair.

    ``service_ip`` is the first IP of the service range (the ``kubernetes``
    Service's ClusterIP); in-cluster clients verify the apiserver by it.
    The admin cert (``O=system:masters``) is also used by the controller-manager,
    scheduler and kwok: per-component identities buy nothing on a test bed and
    cost startup time.
    """
    directory.mkdir(parents=True, exist_ok=True)
    pki = PKI.at(directory)

    ca_key, ca_cert = _new_ca("omnimodel-testbed-ca", pki.ca_key, pki.ca_cert)

    _issue(
        pki.apiserver_key,
        pki.apiserver_cert,
        subject=_name("kube-apiserver"),
        ca_cert=ca_cert,
        ca_key=ca_key,
        server_names=[
            "localhost",
            "kubernetes",
            "kubernetes.default",
            "kubernetes.default.svc",
            "kubernetes.default.svc.cluster.local",
        ],
        server_ips=["127.0.0.1", service_ip],
    )
    _issue(
        pki.admin_key,
        pki.admin_cert,
        subject=_name("kubernetes-admin", "system:masters"),
        ca_cert=ca_cert,
        ca_key=ca_key,
        client=True,
    )

    sa_key = _new_key()
    _write_key(pki.sa_key, sa_key)
    pki.sa_pub.write_bytes(
        sa_key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )

    # Front proxy (aggregation layer): a separate CA whose client cert the
    # apiserver presents to aggregated APIs. Configuring it also stops the
    # controller-manager/scheduler logging "missing requestheader-client-ca-file"
    # several times a second.
    fp_ca_key, fp_ca_cert = _new_ca("omnimodel-testbed-front-proxy-ca", pki.front_proxy_ca_key, pki.front_proxy_ca_cert)
    _issue(
        pki.front_proxy_client_key,
        pki.front_proxy_client_cert,
        subject=_name(FRONT_PROXY_CLIENT),
        ca_cert=fp_ca_cert,
        ca_key=fp_ca_key,
        client=True,
    )
    return pki
