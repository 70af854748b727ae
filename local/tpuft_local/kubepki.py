"""Keys, certificates and kubeconfigs for the local control plane (tpuft_local.controlplane).

One CA signs the kube-apiserver serving cert (127.0.0.1/localhost/kubernetes.default.svc)
and client certs for the admin and kube-controller-manager identities, both in
system:masters. The service-account token signing key is a separate EC key.
`cryptography` is the `local` extra's dependency; imported lazily.
"""
from __future__ import annotations

import base64
import datetime
import ipaddress
import json
from pathlib import Path

CLIENTS = {  # file stem -> (CN, O)
    "admin": ("tpuft-admin", "system:masters"),
    "kube-controller-manager": ("system:kube-controller-manager", "system:masters"),
}
SERVICE_IP = "10.0.0.1"  # first address of --service-cluster-ip-range=10.0.0.0/24


def _write_key(path: Path, key) -> None:
    from cryptography.hazmat.primitives import serialization

    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
    path.chmod(0o600)


def _cert(subject_cn: str, org: str | None, key, issuer_cert, issuer_key, *, ca=False, server=False,
          extra_ips: tuple[str, ...] = ()):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    attrs = [x509.NameAttribute(NameOID.COMMON_NAME, subject_cn)]
    if org:
        attrs.append(x509.NameAttribute(NameOID.ORGANIZATION_NAME, org))
    subject = x509.Name(attrs)
    now = datetime.datetime.now(datetime.timezone.utc)
    b = (x509.CertificateBuilder().subject_name(subject)
         .issuer_name(issuer_cert.subject if issuer_cert else subject)
         .public_key(key.public_key()).serial_number(x509.random_serial_number())
         .not_valid_before(now - datetime.timedelta(hours=1)).not_valid_after(now + datetime.timedelta(days=3650))
         .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if ca:
        b = b.add_extension(x509.KeyUsage(True, False, False, False, False, True, True, False, False), critical=True)
    else:
        b = b.add_extension(x509.KeyUsage(True, False, False, False, False, False, False, False, False), critical=True)
        eku = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
        b = b.add_extension(x509.ExtendedKeyUsage([eku]), critical=False)
    if server:
        names = ["localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc",
                 "kubernetes.default.svc.cluster.local"]
        sans = [x509.DNSName(n) for n in names]
        sans += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ("127.0.0.1", SERVICE_IP, *extra_ips)]
        b = b.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return b.sign(issuer_key or key, hashes.SHA256())


def ensure_pki(pki: Path, server_ips: tuple[str, ...] = ()) -> None:
    """Create pki/{ca,apiserver,admin,kube-controller-manager}.{crt,key} and sa.{key,pub} once.
    `server_ips`: more addresses the apiserver cert covers (the bridge address and the
    `kubernetes` Service IP of a cluster with a node)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    if (pki / "done").exists():
        return
    pki.mkdir(parents=True, exist_ok=True)
    pem = serialization.Encoding.PEM

    def new_key(stem: str):
        key = ec.generate_private_key(ec.SECP256R1())
        _write_key(pki / f"{stem}.key", key)
        return key

    ca_key = new_key("ca")
    ca = _cert("tpuft-local-ca", None, ca_key, None, None, ca=True)
    (pki / "ca.crt").write_bytes(ca.public_bytes(pem))
    server = _cert("kube-apiserver", None, new_key("apiserver"), ca, ca_key, server=True, extra_ips=server_ips)
    (pki / "apiserver.crt").write_bytes(server.public_bytes(pem))
    for stem, (cn, org) in CLIENTS.items():
        (pki / f"{stem}.crt").write_bytes(_cert(cn, org, new_key(stem), ca, ca_key).public_bytes(pem))
    sa = new_key("sa")
    (pki / "sa.pub").write_bytes(sa.public_key().public_bytes(pem, serialization.PublicFormat.SubjectPublicKeyInfo))
    (pki / "done").write_text("ok\n")


def write_kubeconfig(path: Path, server_url: str, pki: Path, client: str = "admin") -> None:
    """A self-contained kubeconfig (certs inlined) for `client`; JSON, which is valid YAML."""
    def b64(name: str) -> str:
        return base64.b64encode((pki / name).read_bytes()).decode()

    config = {
        "apiVersion": "v1", "kind": "Config", "preferences": {},
        "clusters": [{"name": "tpuft-local", "cluster": {"server": server_url,
                                                         "certificate-authority-data": b64("ca.crt")}}],
        "users": [{"name": client, "user": {"client-certificate-data": b64(f"{client}.crt"),
                                            "client-key-data": b64(f"{client}.key")}}],
        "contexts": [{"name": "tpuft-local", "context": {"cluster": "tpuft-local", "user": client,
                                                        "namespace": "default"}}],
        "current-context": "tpuft-local",
    }
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(config, indent=2) + "\n")
    tmp.chmod(0o600)
    tmp.replace(path)


def issue(pki: Path, stem: str, cn: str, org: str | None = None, *, server_ips: tuple[str, ...] = (),
          server_names: tuple[str, ...] = (), client: bool = True) -> tuple[Path, Path]:
    """pki/<stem>.{crt,key} signed by the cluster CA, once: a client cert (CN/O are the user and
    group RBAC sees), a serving cert for `server_ips`/`server_names`, or both. Returns (crt, key)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    crt, key_path = pki / f"{stem}.crt", pki / f"{stem}.key"
    if crt.exists() and key_path.exists():
        return crt, key_path
    ca_key = serialization.load_pem_private_key((pki / "ca.key").read_bytes(), None)
    ca = x509.load_pem_x509_certificate((pki / "ca.crt").read_bytes())
    key = ec.generate_private_key(ec.SECP256R1())
    attrs = [x509.NameAttribute(NameOID.COMMON_NAME, cn)]
    if org:
        attrs.append(x509.NameAttribute(NameOID.ORGANIZATION_NAME, org))
    now = datetime.datetime.now(datetime.timezone.utc)
    b = (x509.CertificateBuilder().subject_name(x509.Name(attrs)).issuer_name(ca.subject)
         .public_key(key.public_key()).serial_number(x509.random_serial_number())
         .not_valid_before(now - datetime.timedelta(hours=1)).not_valid_after(now + datetime.timedelta(days=3650))
         .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
         .add_extension(x509.KeyUsage(True, False, True, False, False, False, False, False, False), critical=True))
    serving = bool(server_ips or server_names)
    ekus = ([ExtendedKeyUsageOID.CLIENT_AUTH] if client else []) + ([ExtendedKeyUsageOID.SERVER_AUTH] if serving else [])
    b = b.add_extension(x509.ExtendedKeyUsage(ekus), critical=False)
    if serving:
        sans = [x509.DNSName(n) for n in server_names]
        sans += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in server_ips]
        b = b.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    _write_key(key_path, key)
    crt.write_bytes(b.sign(ca_key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM))
    return crt, key_path
