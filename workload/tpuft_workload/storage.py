"""Where a run's files live: a local path, or object storage (gs://) through pyarrow.

`filesystem(uri)` is the one place a filesystem is built for a URI: checkpoints, the run manifest,
driver logs, TensorBoard events, datasets and Orbax checkpoints all go through it, so every gs://
call has the same credentials path (Application Default Credentials: on GKE, the metadata server
that Workload Identity Federation for GKE answers) and the same bound on retries. Without a bound,
the Google client inside pyarrow retries a missing token for 15 minutes.

`explain(...)` turns a storage failure into a message that names the bucket, the Kubernetes
service account the pod runs as, and what to grant it (pure); `who_am_i()` and `project()` read
those from the pod (thin I/O).
"""
from __future__ import annotations

import base64
import datetime
import json
import os
import re
import urllib.request
from dataclasses import dataclass

from tpuft.api import constants as c

# Transient errors are retried this long at run time (a checkpoint upload during a GCS blip); the
# probe before Ray starts gives up sooner, so a missing credential or bucket fails in seconds.
RETRY_LIMIT_S = 60.0
PROBE_RETRY_LIMIT_S = 5.0
GCS_SCHEME = "gs://"
SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
# the pod's KSA and its namespace, which the operator sets from the downward API (read when no token is mounted)
ENV_SERVICE_ACCOUNT = c.SERVICE_ACCOUNT_ENV
ENV_NAMESPACE = c.SERVICE_ACCOUNT_NAMESPACE_ENV
BUCKET_ROLE = "roles/storage.objectUser"        # read, write and delete objects; no bucket admin
METADATA_ROOT = "metadata.google.internal"
METADATA_TIMEOUT_S = 2.0


def is_remote(uri: str) -> bool:
    return "://" in uri


def filesystem(uri: str, retry_limit_s: float = RETRY_LIMIT_S):
    """(pyarrow filesystem, path in it) for a local path or a URI such as gs://bucket/dir."""
    import pyarrow.fs as pafs

    if not is_remote(uri):
        return pafs.LocalFileSystem(), os.path.abspath(uri)
    if uri.startswith(GCS_SCHEME):
        return (pafs.GcsFileSystem(retry_time_limit=datetime.timedelta(seconds=retry_limit_s)),
                uri[len(GCS_SCHEME):])
    return pafs.FileSystem.from_uri(uri)


def bucket_of(uri: str) -> str:
    return uri.split("://", 1)[1].split("/", 1)[0] if is_remote(uri) else ""


class NotFound(FileNotFoundError):
    """An object the run reads does not exist; the message names its URI."""


def require(uri: str, what: str) -> None:
    """Raise NotFound (naming `what` and `uri`) unless `uri` is a file or a directory."""
    import pyarrow.fs as pafs

    fs, path = filesystem(uri)
    if fs.get_file_info(path.rstrip("/")).type == pafs.FileType.NotFound:
        raise NotFound(f"{what} {uri} not found")


def make_dirs(fs, path: str) -> None:
    """`path` and its parents on a local filesystem; nothing on object storage, where a folder is a
    name prefix. pyarrow's GCS create_dir reads the bucket's metadata (a bucket-level permission,
    beyond the objects a run writes), writes marker objects and creates a missing bucket."""
    import pyarrow.fs as pafs

    if isinstance(fs, pafs.LocalFileSystem):
        fs.create_dir(path, recursive=True)


UPLOAD_THREADS = 8


def upload_files(fs, local_dir: str, path: str) -> None:
    """Every file under `local_dir` to `path`/<its relative path> on object storage, object by object
    (pyarrow's copy_files would create_dir: `make_dirs`), UPLOAD_THREADS at a time."""
    import shutil
    from concurrent.futures import ThreadPoolExecutor
    from pathlib import Path

    def put(file: Path) -> None:
        with open(file, "rb") as src, fs.open_output_stream(f"{path.rstrip('/')}/{file.relative_to(local_dir).as_posix()}") as dst:
            shutil.copyfileobj(src, dst, 8 << 20)

    files = sorted(f for f in Path(local_dir).rglob("*") if f.is_file())
    with ThreadPoolExecutor(UPLOAD_THREADS) as pool:
        list(pool.map(put, files))   # list(): the first failure raises here


def download_files(fs, path: str, local_dir: str) -> None:
    """Every object under `path` to `local_dir`/<its relative path>, folders made here (object storage
    lists no folders, so pyarrow's copy_files would not make them), UPLOAD_THREADS at a time."""
    import shutil
    from concurrent.futures import ThreadPoolExecutor
    from pathlib import Path

    import pyarrow.fs as pafs

    base = path.rstrip("/") + "/"
    files = [i.path for i in fs.get_file_info(pafs.FileSelector(path, recursive=True)) if i.type == pafs.FileType.File]

    def get(remote: str) -> None:
        dest = Path(local_dir, remote[len(base):])
        dest.parent.mkdir(parents=True, exist_ok=True)
        with fs.open_input_stream(remote) as src, open(dest, "wb") as dst:
            shutil.copyfileobj(src, dst, 8 << 20)

    with ThreadPoolExecutor(UPLOAD_THREADS) as pool:
        list(pool.map(get, files))


# ---- who the pod is, and what to grant it --------------------------------------------------------

@dataclass(frozen=True)
class PodIdentity:
    """The Kubernetes service account the pod runs as (None where it cannot be told) and where that came from."""
    namespace: str | None
    service_account: str | None
    source: str


@dataclass(frozen=True)
class Project:
    id: str | None
    number: str | None


def identity_from_token(token: str) -> tuple[str | None, str | None]:
    """(namespace, service account) from a Kubernetes service-account token's claims: a projected
    token's `kubernetes.io` claim, else a legacy token's `kubernetes.io/serviceaccount/*` ones."""
    try:
        payload = token.split(".")[1]
        claims = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    except (IndexError, ValueError):
        return None, None
    k8s = claims.get("kubernetes.io") if isinstance(claims.get("kubernetes.io"), dict) else {}
    namespace = k8s.get("namespace") or claims.get("kubernetes.io/serviceaccount/namespace")
    name = (k8s.get("serviceaccount") or {}).get("name") or claims.get("kubernetes.io/serviceaccount/service-account.name")
    return namespace, name


def who_am_i(sa_dir: str | None = None, env: dict | None = None) -> PodIdentity:
    """The pod's namespace and service account: its mounted token first, else the env the operator sets."""
    sa_dir = sa_dir or SA_DIR
    env = os.environ if env is None else env
    try:
        with open(os.path.join(sa_dir, "token")) as f:
            namespace, name = identity_from_token(f.read().strip())
        if namespace and name:
            return PodIdentity(namespace, name, f"its token in {sa_dir}")
    except OSError:
        pass
    if env.get(ENV_SERVICE_ACCOUNT):
        return PodIdentity(env.get(ENV_NAMESPACE), env[ENV_SERVICE_ACCOUNT], f"${ENV_SERVICE_ACCOUNT}")
    return PodIdentity(None, None, f"no token in {sa_dir} and no ${ENV_SERVICE_ACCOUNT}")


def _metadata(path: str) -> str | None:
    root = os.environ.get("GCE_METADATA_ROOT") or METADATA_ROOT
    request = urllib.request.Request(f"http://{root}/computeMetadata/v1/{path}", headers={"Metadata-Flavor": "Google"})
    try:
        with urllib.request.urlopen(request, timeout=METADATA_TIMEOUT_S) as r:
            return r.read().decode().strip() or None
    except (OSError, ValueError):
        return None


def project() -> Project:
    """The project id and number from the metadata server, None where it does not answer."""
    return Project(_metadata("project/project-id"), _metadata("project/numeric-project-id"))


def principal(pod: PodIdentity, proj: Project) -> str:
    """The pod's Workload Identity Federation for GKE principal (placeholders where unknown)."""
    return ("principal://iam.googleapis.com/projects/"
            f"{proj.number or 'PROJECT_NUMBER'}/locations/global/workloadIdentityPools/"
            f"{proj.id or 'PROJECT_ID'}.svc.id.goog/subject/ns/{pod.namespace or 'NAMESPACE'}"
            f"/sa/{pod.service_account or 'KSA_NAME'}")


# what the storage said -> what is wrong (the Google client's status codes and HTTP statuses)
PROBLEMS = (
    ("no credentials", re.compile(r"OAuth2 access token|UNAUTHENTICATED|\b401\b|credentials", re.I)),
    ("bucket not found", re.compile(r"bucket.*(not found|does not exist)|NoSuchBucket|not found.*bucket", re.I)),
    ("permission denied", re.compile(r"PERMISSION_DENIED|\b403\b|Forbidden|does not have storage\.", re.I)),
    ("not found", re.compile(r"NOT_FOUND|\b404\b|not found", re.I)),
)


def problem(error: str, not_found: str = "not found") -> str:
    """What `error` says is wrong; `not_found`: what a plain "not found" means for the call that failed."""
    found = next((name for name, pattern in PROBLEMS if pattern.search(error)), "error")
    return not_found if found == "not found" else found


def storage_words(error: str, limit: int = 600) -> str:
    """The storage's own message, without the client's retry metadata."""
    text = error.split(" error_info=", 1)[0].strip()
    return text if len(text) <= limit else text[:limit] + "..."


def explain(uri: str, doing: str, error: str, pod: PodIdentity, proj: Project, not_found: str = "not found") -> str:
    """`doing` `uri` failed with `error`: what is wrong, who the pod is, what to do."""
    bucket = bucket_of(uri)
    what = problem(error, not_found)
    head = f"{doing} {uri} failed: {what} (the storage said: {storage_words(error)})"
    if not uri.startswith(GCS_SCHEME):
        return head
    who = (f"the pod runs as Kubernetes service account {pod.namespace or 'NAMESPACE'}/{pod.service_account} "
           f"(from {pod.source})" if pod.service_account else
           f"the pod's Kubernetes service account is unknown ({pod.source})")
    grant = (f"grant {BUCKET_ROLE} on bucket {bucket} to {principal(pod, proj)} "
             f"(gcloud storage buckets add-iam-policy-binding gs://{bucket} --role={BUCKET_ROLE} "
             f"--member={principal(pod, proj)})")
    if what == "bucket not found":
        todo = f"bucket {bucket} does not exist: create it (gcloud storage buckets create gs://{bucket}) or fix the path"
    elif what == "no credentials":
        todo = ("no Google access token could be had: run the pod on a GKE cluster and node pool with Workload "
                "Identity Federation for GKE enabled (the GKE metadata server answers the pod's token requests), "
                f"then {grant}")
    else:
        todo = f"{grant}"
    return f"{head}; {who}; {todo}"


def failure(uri: str, doing: str, exc: BaseException, not_found: str = "not found") -> str:
    """`explain` with the pod's identity and project read now (for a gs:// URI only)."""
    error = f"{type(exc).__name__}: {exc}"
    if not uri.startswith(GCS_SCHEME):
        return explain(uri, doing, error, PodIdentity(None, None, ""), Project(None, None), not_found)
    return explain(uri, doing, error, who_am_i(), project(), not_found)
