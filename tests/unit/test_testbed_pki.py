"""The generated PKI must satisfy the apiserver and in-cluster clients."""

from __future__ import annotations

import ipaddress
import ssl
from pathlib import Path

from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from omnimodel_testbed.pki import generate_pki


def _cert(p: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(p.read_bytes())


def test_apiserver_cert_covers_every_name_clients_use(tmp_path: Path) -> None:
    pki = generate_pki(tmp_path, service_ip="10.96.0.1")
    cert = _cert(pki.apiserver_cert)
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert {"localhost", "kubernetes.default.svc", "kubernetes.default.svc.cluster.local"} <= set(
        san.get_values_for_type(x509.DNSName)
    )
    assert {ipaddress.ip_address("127.0.0.1"), ipaddress.ip_address("10.96.0.1")} <= set(
        san.get_values_for_type(x509.IPAddress)
    )
    cert.verify_directly_issued_by(_cert(pki.ca_cert))


def test_admin_cert_is_cluster_admin_client(tmp_path: Path) -> None:
    pki = generate_pki(tmp_path, service_ip="10.96.0.1")
    cert = _cert(pki.admin_cert)
    orgs = [a.value for a in cert.subject.get_attributes_for_oid(NameOID.ORGANIZATION_NAME)]
    assert orgs == ["system:masters"]
    eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert ExtendedKeyUsageOID.CLIENT_AUTH in eku
    cert.verify_directly_issued_by(_cert(pki.ca_cert))


def test_files_load_into_python_ssl_and_keys_are_private(tmp_path: Path) -> None:
    pki = generate_pki(tmp_path, service_ip="10.96.0.1")
    assert pki.exists()
    ctx = ssl.create_default_context(cafile=str(pki.ca_cert))
    ctx.load_cert_chain(str(pki.admin_cert), str(pki.admin_key))
    for key in (pki.ca_key, pki.apiserver_key, pki.admin_key, pki.sa_key):
        assert key.stat().st_mode & 0o077 == 0


def test_only_the_ca_may_sign_certificates(tmp_path: Path) -> None:
    pki = generate_pki(tmp_path, service_ip="10.96.0.1")
    for path, ca in ((pki.ca_cert, True), (pki.apiserver_cert, False), (pki.admin_cert, False)):
        cert = _cert(path)
        assert cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is ca
        usage = cert.extensions.get_extension_for_class(x509.KeyUsage).value
        assert (usage.digital_signature, usage.key_cert_sign, usage.crl_sign) == (True, ca, ca)
