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
    *,
    subject: x509.Name,
    key: ec.EllipticCurvePrivateKey,
    ca_cert: x509.Certificate,
    ca_key: ec.EllipticCurvePrivateKey,
    server_names: list[str] | None = None,
    server_ips: list[str] | None = None,
    client: bool = False,
) -> x509.Certificate:
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
    return builder.sign(ca_key, hashes.SHA256())


def _new_ca(cn: str) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = _new_key()
    subject = _name(cn)
    cert = (
        _builder(subject, subject, key, ca=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
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

    ca_key, ca_cert = _new_ca("omnimodel-testbed-ca")
    _write_key(pki.ca_key, ca_key)
    _write_cert(pki.ca_cert, ca_cert)

    api_key = _new_key()
    api_cert = _issue(
        subject=_name("kube-apiserver"),
        key=api_key,
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
    _write_key(pki.apiserver_key, api_key)
    _write_cert(pki.apiserver_cert, api_cert)

    admin_key = _new_key()
    admin_cert = _issue(
        subject=_name("kubernetes-admin", "system:masters"),
        key=admin_key,
        ca_cert=ca_cert,
        ca_key=ca_key,
        client=True,
    )
    _write_key(pki.admin_key, admin_key)
    _write_cert(pki.admin_cert, admin_cert)

    sa_key = _new_key()
    _write_key(pki.sa_key, sa_key)
    pki.sa_pub.write_bytes(
        sa_key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )

    # Front proxy (aggregation layer): a separate CA whose client cert the
    # apiserver presents to aggregated APIs. Configuring it also stops the
    # controller-manager/scheduler logging "missing requestheader-client-ca-file"
    # several times a second.
    fp_ca_key, fp_ca_cert = _new_ca("omnimodel-testbed-front-proxy-ca")
    _write_key(pki.front_proxy_ca_key, fp_ca_key)
    _write_cert(pki.front_proxy_ca_cert, fp_ca_cert)
    fp_key = _new_key()
    fp_cert = _issue(
        subject=_name(FRONT_PROXY_CLIENT),
        key=fp_key,
        ca_cert=fp_ca_cert,
        ca_key=fp_ca_key,
        client=True,
    )
    _write_key(pki.front_proxy_client_key, fp_key)
    _write_cert(pki.front_proxy_client_cert, fp_cert)
    return pki
