"""LoRA adapters served side by side on one base: the adapters root's layout, publishing into it,
and reading it (docs/serving.md, "Adapters on a shared base").

One adapter is `<adapters root>/<name>/`: a PEFT adapter folder as tpuft_workload.lora's export
writes it, plus PUBLICATION (tpuft-publication.json), written last, so its presence means the
folder is complete. `publish` copies an export into `<root>/<name>.staging-<uid>` first (a name that
is never an adapter name: it holds a '.'), so an interrupted copy leaves no marker where the server
looks. `unpublish` deletes only the publication its caller made (the marker's uid).

The server's side: `Registry` lists the root (markers only) and resolves a request's adapter to an
`AdapterRef` (a local folder, its uid and its stop ids); `Lru` decides which loaded adapter a
replica evicts. Both are pure of torch.
"""
from __future__ import annotations

import contextlib
import datetime
import json
import os
import shutil
import tempfile
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from tpuft.api.spec import DNS_LABEL, MAX_LABEL_LENGTH
from tpuft_workload import checkpoint, storage

PUBLICATION = "tpuft-publication.json"
STAGING_INFIX = ".staging-"
REPLACED_INFIX = ".replaced-"
# A served adapter's marker is read again at most this often, so a republished adapter (a new uid) is
# reloaded within this long without a storage read per request.
MARKER_TTL_S = 5.0
ADAPTER_CACHE_DIR = "adapters"   # under TPUFT_MODEL_CACHE: local copies of gs:// adapters, per uid


class PublishError(RuntimeError):
    """Publishing or unpublishing failed; the message names the URI and what to do."""


def check_name(name: str) -> str:
    """`name` when it is a DNS-1123 label (what a model id's adapter part may be), else ValueError."""
    if not (isinstance(name, str) and len(name) <= MAX_LABEL_LENGTH and DNS_LABEL.match(name)):
        raise ValueError(f"adapter name {name!r} is not a DNS-1123 label: use lowercase letters, digits and '-', "
                         f"starting and ending with a letter or digit, at most {MAX_LABEL_LENGTH} characters")
    return name


def is_name(name: str) -> bool:
    try:
        check_name(name)
    except ValueError:
        return False
    return True


@dataclass(frozen=True)
class Publication:
    """tpuft-publication.json: who published the adapter folder, with what eval loss on which eval set."""
    adapter: str
    source: str              # namespace/name of the fine-tune
    uid: str                 # its metadata.uid
    eval_loss: float | None
    eval_set: str | None     # the eval set's fingerprint (tpuft's); None: published without an eval set
    published_at: str        # RFC 3339, UTC

    def to_json(self) -> dict:
        return {"adapter": self.adapter, "source": self.source, "uid": self.uid, "evalLoss": self.eval_loss,
                "evalSet": self.eval_set, "publishedAt": self.published_at}

    @classmethod
    def parse(cls, doc: object, where: str) -> Publication:
        """The marker's JSON -> Publication; ValueError naming `where` and the field at fault."""
        if not isinstance(doc, dict):
            raise ValueError(f"{where}: the publication marker is not a JSON object")
        for key in ("adapter", "source", "uid", "publishedAt"):
            if not isinstance(doc.get(key), str) or not doc[key]:
                raise ValueError(f"{where}: the publication marker's {key} must be a non-empty string, "
                                 f"got {doc.get(key)!r}")
        loss, eval_set = doc.get("evalLoss"), doc.get("evalSet")
        if loss is not None and (isinstance(loss, bool) or not isinstance(loss, (int, float))):
            raise ValueError(f"{where}: the publication marker's evalLoss must be a number or null, got {loss!r}")
        if eval_set is not None and not isinstance(eval_set, str):
            raise ValueError(f"{where}: the publication marker's evalSet must be a string or null, got {eval_set!r}")
        return cls(doc["adapter"], doc["source"], doc["uid"], None if loss is None else float(loss),
                   eval_set or None, doc["publishedAt"])


def rfc3339(now: float | None = None) -> str:
    moment = datetime.datetime.fromtimestamp(time.time() if now is None else now, datetime.timezone.utc)
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


# ---- files -------------------------------------------------------------------------------------

def _files(uri: str) -> list[str]:
    """The paths (relative, '/'-separated) of every file under `uri`; [] when there is none."""
    import pyarrow.fs as pafs

    fs, path = storage.filesystem(uri)
    if fs.get_file_info(path.rstrip("/")).type == pafs.FileType.NotFound:
        return []
    base = path.rstrip("/") + "/"
    return sorted(i.path[len(base):] for i in fs.get_file_info(pafs.FileSelector(path, recursive=True))
                  if i.type == pafs.FileType.File)


def _delete_file(uri: str) -> None:
    """The file `uri`; nothing when it does not exist."""
    fs, path = storage.filesystem(uri)
    try:
        fs.delete_file(path)
    except FileNotFoundError:
        pass


def _delete_tree(uri: str) -> None:
    """`uri` and everything under it; nothing when it does not exist."""
    fs, path = storage.filesystem(uri)
    if not storage.is_remote(uri):
        if os.path.isdir(path):
            shutil.rmtree(path)
        return
    for rel in _files(uri):
        fs.delete_file(f"{path.rstrip('/')}/{rel}")


def _copy_tree(src: str, dest: str, skip: tuple[str, ...] = ()) -> list[str]:
    """Every file under `src` to the same relative path under `dest` (but `skip`'s); the copied paths.
    Same filesystem: copied in place (a GCS server-side copy); otherwise through a local folder."""
    names = [n for n in _files(src) if n not in skip]
    if not names:
        raise storage.NotFound(f"{src} not found or empty")
    src_fs, src_path = storage.filesystem(src)
    dest_fs, dest_path = storage.filesystem(dest)
    if type(src_fs) is type(dest_fs) and storage.is_remote(src) == storage.is_remote(dest):
        for rel in names:
            target = f"{dest_path.rstrip('/')}/{rel}"
            storage.make_dirs(dest_fs, target.rpartition("/")[0])
            src_fs.copy_file(f"{src_path.rstrip('/')}/{rel}", target)
        return names
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint.download_dir(src, tmp)
        for rel in skip:
            Path(tmp, rel).unlink(missing_ok=True)
        checkpoint.upload_dir(tmp, dest)
    return names


def read_publication(folder_uri: str) -> Publication | None:
    """The marker of an adapter folder; None when it has none (not published, or still being copied)."""
    uri = checkpoint.join(folder_uri, PUBLICATION)
    try:
        doc = json.loads(checkpoint.read_bytes(uri).decode())
    except storage.NotFound:
        return None
    return Publication.parse(doc, uri)


@contextlib.contextmanager
def _failing(uri: str, doing: str):
    """A storage failure inside becomes PublishError naming `uri`, the pod's identity and what to grant."""
    try:
        yield
    except (PublishError, ValueError):
        raise
    except Exception as e:  # noqa: BLE001 - pyarrow raises OSError, ArrowException, PermissionError...
        raise PublishError(storage.failure(uri, doing, e)) from None


# ---- publish / unpublish -----------------------------------------------------------------------

def publish(export: str, root: str, name: str, source: str, uid: str, eval_set: str | None,
            eval_loss: float | None = None, now: float | None = None) -> dict:
    """Copy the adapter folder `export` to `<root>/<name>`, its marker written last; what was written."""
    check_name(name)
    if not uid:
        raise ValueError("--uid must be the fine-tune's metadata.uid, got an empty string")
    final, staging = checkpoint.join(root, name), checkpoint.join(root, f"{name}{STAGING_INFIX}{uid}")
    publication = Publication(name, source, uid, eval_loss, eval_set or None, rfc3339(now))
    marker = json.dumps(publication.to_json(), sort_keys=True).encode()
    with _failing(export, "reading the adapter export"):
        if "adapter_config.json" not in _files(export):
            raise PublishError(f"{export} is not a LoRA adapter export (no adapter_config.json): publish the folder "
                               "a LoRA fine-tune's training wrote (status.training.exportedModel)")
    with _failing(staging, "copying the adapter to"):
        _delete_tree(staging)   # a copy an earlier, interrupted attempt left
        files = _copy_tree(export, staging, skip=(PUBLICATION,))
    if storage.is_remote(root):
        with _failing(final, "replacing"):
            # the old marker first: from here the server sees the name as not published, not half-copied
            _delete_file(checkpoint.join(final, PUBLICATION))
            _delete_tree(final)
            _copy_tree(staging, final)
            checkpoint.write_bytes(checkpoint.join(final, PUBLICATION), marker)
            _delete_tree(staging)
    else:
        with _failing(final, "replacing"):
            checkpoint.write_bytes(checkpoint.join(staging, PUBLICATION), marker)
            replaced = checkpoint.join(root, f"{name}{REPLACED_INFIX}{uid}")
            _delete_tree(replaced)
            if os.path.isdir(final):
                os.rename(final, replaced)   # a directory cannot be renamed onto a non-empty one
            os.rename(staging, final)
            _delete_tree(replaced)
    return {"published": final, "files": [*files, PUBLICATION], **publication.to_json()}


def unpublish(root: str, name: str, uid: str) -> dict:
    """Delete `<root>/<name>` when its marker's uid is `uid`; otherwise delete nothing and say whose it is."""
    check_name(name)
    folder = checkpoint.join(root, name)
    with _failing(folder, "reading the publication of"):
        current = read_publication(folder)
    if current is None:
        return {"unpublished": False, "adapter": name, "reason": f"{folder} holds no published adapter"}
    if current.uid != uid:
        return {"unpublished": False, "adapter": name,
                "reason": f"{folder} is published by {current.source} (uid {current.uid}), not by uid {uid}: "
                          "left as it is"}
    with _failing(folder, "deleting"):
        _delete_file(checkpoint.join(folder, PUBLICATION))   # first: the server stops listing it at once
        _delete_tree(folder)
    return {"unpublished": True, "adapter": name, "folder": folder, "source": current.source, "uid": uid}


# ---- the server's side -------------------------------------------------------------------------

def list_published(root: str) -> dict[str, Publication]:
    """Every adapter folder under `root` whose marker is there and valid, by name (sorted). One
    recursive listing: pyarrow's GCS filesystem lists no folders non-recursively."""
    names = sorted({rel.split("/")[0] for rel in _files(root)
                    if rel.count("/") == 1 and rel.endswith("/" + PUBLICATION) and is_name(rel.split("/")[0])})
    found: dict[str, Publication] = {}
    for name in names:
        try:
            publication = read_publication(checkpoint.join(root, name))
        except ValueError:   # a marker that does not parse: not served
            continue
        if publication is not None:
            found[name] = publication
    return found


@dataclass(frozen=True)
class AdapterRef:
    """One published adapter as the engine loads it: a local folder and what identifies its version."""
    name: str
    uid: str
    path: str                  # local folder
    stop_ids: frozenset


def local_folder(root: str, name: str, uid: str) -> str:
    """The adapter folder on local disk: itself for a local root; a copy per uid for gs:// (made once)."""
    folder = checkpoint.join(root, name)
    if not storage.is_remote(root):
        return folder
    cache = Path(os.environ.get("TPUFT_MODEL_CACHE", "/tmp/tpuft-model-cache"), ADAPTER_CACHE_DIR, f"{name}-{uid}")
    if not (cache / ".complete").exists():
        shutil.rmtree(cache, ignore_errors=True)
        checkpoint.download_dir(folder, str(cache))
        (cache / ".complete").touch()
    return str(cache)


def stop_ids(folder: str, tokenizer, fallback: frozenset) -> frozenset:
    """The adapter's stop ids: its generation_config.json's eos_token_id (the export puts the chat
    template's turn end there), else the tokenizer's EOS, else `fallback` (the base's)."""
    from transformers import GenerationConfig
    from transformers.utils import GENERATION_CONFIG_NAME

    eos = None
    if os.path.isfile(os.path.join(folder, GENERATION_CONFIG_NAME)):
        eos = GenerationConfig.from_pretrained(folder).eos_token_id
    eos = getattr(tokenizer, "eos_token_id", None) if eos is None else eos
    ids = frozenset(eos if isinstance(eos, list) else [eos]) - {None}
    return ids or fallback


class Registry:
    """The replica's view of the adapters root: the published names (re-listed on `refresh`, and when
    an unknown name is asked for) and, per name, its AdapterRef and tokenizer (loaded once per uid)."""

    def __init__(self, root: str, base_tokenizer, base_stop_ids: frozenset, clock=time.monotonic):
        self.root, self.base_tokenizer, self.base_stop_ids, self.clock = root, base_tokenizer, base_stop_ids, clock
        self._lock = threading.Lock()
        self._published: dict[str, Publication] = {}
        self._checked: dict[str, float] = {}          # name -> when its marker was last read
        self._loaded: dict[str, tuple[AdapterRef, object]] = {}   # name -> (ref, tokenizer)

    def refresh(self) -> list[str]:
        """List the root again; the published names."""
        published = list_published(self.root)
        now = self.clock()
        with self._lock:
            self._published = published
            self._checked = {n: now for n in published}
        return list(published)

    def resolve(self, name: str) -> tuple[AdapterRef, object] | None:
        """(the adapter's AdapterRef, its tokenizer), or None when `name` is not published."""
        if not is_name(name):
            return None
        with self._lock:
            known = self._published.get(name)
            fresh = known is not None and self.clock() - self._checked.get(name, 0.0) < MARKER_TTL_S
        if known is None:
            self.refresh()
        elif not fresh:
            self._check(name)
        with self._lock:
            publication = self._published.get(name)
            loaded = self._loaded.get(name)
        if publication is None:
            return None
        if loaded is not None and loaded[0].uid == publication.uid:
            return loaded
        return self._load(name, publication.uid)

    def _check(self, name: str) -> None:
        publication = read_publication(checkpoint.join(self.root, name))
        with self._lock:
            if publication is None:
                self._published.pop(name, None)
            else:
                self._published[name] = publication
            self._checked[name] = self.clock()

    def _load(self, name: str, uid: str) -> tuple[AdapterRef, object]:
        from transformers import AutoTokenizer

        folder = local_folder(self.root, name, uid)
        has_tokenizer = any(Path(folder, f).is_file() for f in ("tokenizer.json", "tokenizer_config.json"))
        tokenizer = AutoTokenizer.from_pretrained(folder) if has_tokenizer else self.base_tokenizer
        loaded = (AdapterRef(name, uid, folder, stop_ids(folder, tokenizer, self.base_stop_ids)), tokenizer)
        with self._lock:
            self._loaded[name] = loaded
        return loaded


class Lru:
    """Which adapters a replica holds, at most `capacity`, least recently used first out (pure)."""

    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"max_adapters must be at least 1, got {capacity}")
        self.capacity = capacity
        self._held: OrderedDict[str, str] = OrderedDict()   # name -> uid

    def use(self, name: str, uid: str) -> tuple[bool, list[str]]:
        """Mark `name` (at `uid`) used: (whether it must be loaded, the names to unload first-out: a
        different uid of the same name, and the least recently used past capacity)."""
        held = self._held.pop(name, None)
        load = held != uid
        out = [name] if held is not None and load else []
        self._held[name] = uid
        while len(self._held) > self.capacity:
            out.append(self._held.popitem(last=False)[0])
        return load, out

    def forget(self, name: str) -> None:
        self._held.pop(name, None)

    @property
    def names(self) -> list[str]:
        """Held names, least recently used first."""
        return list(self._held)
