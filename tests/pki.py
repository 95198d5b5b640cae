"""A throwaway PKI for the TLS tests: a CA, a server and a client certificate, valid for
127.0.0.1 and localhost."""
from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _pem_key(key) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _builder(subject: x509.Name, issuer: x509.Name, public_key) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.timezone.utc)
    return (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer)
            .public_key(public_key).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1)))


def make_ca(cn: str):
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (_builder(_name(cn), _name(cn), key.public_key())
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
            .sign(key, hashes.SHA256()))
    return key, cert


def issue(ca, cn: str, usage, dns_names: tuple[str, ...] | None = None) -> tuple[bytes, bytes]:
    """→ (certificate PEM, key PEM) signed by the CA, valid for 127.0.0.1 and localhost, or
    for `dns_names` alone (no address); `usage` one extended key usage or a list of them."""
    ca_key, ca_cert = ca
    key = ec.generate_private_key(ec.SECP256R1())
    names = ([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))] if dns_names is None
             else [x509.DNSName(name) for name in dns_names])
    cert = (_builder(_name(cn), ca_cert.subject, key.public_key())
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.ExtendedKeyUsage(usage if isinstance(usage, list) else [usage]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    return cert.public_bytes(serialization.Encoding.PEM), _pem_key(key)


def write_pki(directory: Path, cn: str = "specdec") -> tuple[dict[str, bytes], dict[str, str]]:
    """A CA and a server and a client certificate it signed, written as PEM files into
    `directory`: → (PEM bytes, file paths), by name: ca, server, server-key, client, client-key."""
    ca = make_ca(f"{cn} test CA")
    files = {"ca": ca[1].public_bytes(serialization.Encoding.PEM)}
    files["server"], files["server-key"] = issue(ca, f"{cn} server", ExtendedKeyUsageOID.SERVER_AUTH)
    files["client"], files["client-key"] = issue(ca, f"{cn} orchestrator", ExtendedKeyUsageOID.CLIENT_AUTH)
    paths = {}
    for name, data in files.items():
        (directory / f"{name}.pem").write_bytes(data)
        paths[name] = str(directory / f"{name}.pem")
    return files, paths
