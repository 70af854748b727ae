"""Reading a run's files in object storage (gs://) from a laptop: `tpuft logs` prints the driver's
log and `tpuft plot` the TensorBoard events that the workload keeps under spec.checkpoint.storagePath.

`read_bytes(uri)` gives one object, `list_files(uri)` every object under a prefix (recursively: GCS
has no folders, only name prefixes). Both go through pyarrow's GCS client (the workload's own, in
tpuft_workload.storage), imported here only when a gs:// path is read: pyarrow is no dependency of
the operator or its image. Credentials are Application Default Credentials (`gcloud auth
application-default login` on a laptop); the client honours CLOUD_STORAGE_EMULATOR_ENDPOINT and
GCE_METADATA_ROOT, which point it at the local cluster's stand-ins (`tpuft cluster env`).

The client's retries are bounded (RETRY_LIMIT_S): unbounded, a laptop without credentials waits
some 15 minutes for a token; bounded, it is told in seconds. Every failure is a StoreError whose message names the URI, what is
wrong and what to do.
"""
from __future__ import annotations

import datetime
import re

GCS_SCHEME = "gs://"
RETRY_LIMIT_S = 5.0   # a read without a token gave up after 11 s with it, a listing after 10 s
LOGIN = "gcloud auth application-default login"
READER_ROLE = "roles/storage.objectViewer"


class StoreError(RuntimeError):
    """A file in object storage cannot be read here: the message says which, why and what to do."""


class NotFound(StoreError):
    """No object at that URI (or under that prefix)."""


def is_remote(path: str) -> bool:
    return "://" in path


def bucket_of(uri: str) -> str:
    return uri.split("://", 1)[1].split("/", 1)[0]


def _filesystem(uri: str, retry_limit_s: float):
    """(pyarrow's GCS filesystem, the path in it: bucket/object)."""
    if not uri.startswith(GCS_SCHEME):
        raise StoreError(f"{uri}: only {GCS_SCHEME} paths are read from object storage here")
    try:
        import pyarrow.fs as pafs  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        raise StoreError(f"cannot read {uri} here: install pyarrow (pip install pyarrow) to read {GCS_SCHEME} here, "
                         f"or `gcloud storage cat {uri}`") from None
    return pafs.GcsFileSystem(retry_time_limit=datetime.timedelta(seconds=retry_limit_s)), uri[len(GCS_SCHEME):]


# what the Google client said -> what is wrong (its status codes, and HTTP statuses)
PROBLEMS = (
    ("no credentials", re.compile(r"OAuth2 access token|UNAUTHENTICATED|\b401\b|credentials", re.I)),
    ("bucket not found", re.compile(r"bucket.*(not found|does not exist)|NoSuchBucket|not found.*bucket", re.I)),
    ("permission denied", re.compile(r"PERMISSION_DENIED|\b403\b|Forbidden|does not have storage\.", re.I)),
    ("not found", re.compile(r"NOT_FOUND|\b404\b|not found|does not exist", re.I)),
)


def problem(error: str) -> str:
    """Pure: what `error` (the client's message) says is wrong; "error" when it says none of PROBLEMS."""
    return next((name for name, pattern in PROBLEMS if pattern.search(error)), "error")


def explain(uri: str, doing: str, error: str) -> StoreError:
    """Pure: `doing` `uri` failed with `error`: what is wrong and what to do, as the StoreError to raise."""
    said = error.split(" error_info=", 1)[0].strip()[:600]   # without the client's retry metadata
    what, bucket = problem(error), bucket_of(uri)
    head = f"{doing} {uri} failed: {what} (the storage said: {said})"
    if what == "not found":
        return NotFound(f"{uri} not found")
    if what == "no credentials":
        todo = (f"no Google access token could be had here: run `{LOGIN}` (or set "
                "GOOGLE_APPLICATION_CREDENTIALS); for the local cluster's bucket, eval \"$(tpuft cluster env)\"")
    elif what == "bucket not found":
        todo = f"bucket {bucket} does not exist: check spec.checkpoint.storagePath"
    elif what == "permission denied":
        todo = f"your Google account may not read bucket {bucket}: ask for {READER_ROLE} on it"
    else:
        todo = f"try again, or `gcloud storage cat {uri}`"
    return StoreError(f"{head}; {todo}")


def read_bytes(uri: str, retry_limit_s: float = RETRY_LIMIT_S) -> bytes:
    """The object at `uri` (gs://bucket/path), whole."""
    fs, path = _filesystem(uri, retry_limit_s)   # first: it says how to install pyarrow when it is missing
    import pyarrow.fs as pafs  # type: ignore[import-not-found,unused-ignore]

    try:
        with fs.open_input_stream(path) as f:
            return f.read()
    except OSError as e:
        error = f"{type(e).__name__}: {e}"
    if problem(error) in ("no credentials", "permission denied"):
        raise explain(uri, "reading", error)
    # the client's message for a missing object does not say so: ask what is there
    try:
        missing = fs.get_file_info(path).type == pafs.FileType.NotFound
    except OSError:
        missing = False
    raise (NotFound(f"{uri} not found") if missing else explain(uri, "reading", error))


def list_files(uri: str, retry_limit_s: float = RETRY_LIMIT_S) -> list[str]:
    """The URIs of every object under the prefix `uri`, recursively, in name order; [] when none."""
    fs, path = _filesystem(uri, retry_limit_s)
    import pyarrow.fs as pafs  # type: ignore[import-not-found,unused-ignore]

    path = path.rstrip("/")
    try:
        infos = fs.get_file_info(pafs.FileSelector(path, recursive=True, allow_not_found=True))
    except OSError as e:
        raise explain(uri, "listing", f"{type(e).__name__}: {e}") from None
    return sorted(GCS_SCHEME + i.path for i in infos if i.type == pafs.FileType.File)
