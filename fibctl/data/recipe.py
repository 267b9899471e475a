"""Data recipes: which corpora, in what token shares, which held-out sets, which tokenizer.

A recipe is a TOML file (shipped ones live in `fibctl/recipes/`). It is parsed into frozen,
typed dataclasses and hashed; the hash identifies what `fibctl data prepare` built from it.
Source and held-out set names become file names, so they follow `fibctl.names.NAME_PATTERN`.
"""

from __future__ import annotations

import dataclasses
import errno
import glob
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from fibctl.errors import FibctlError, printable, shown_path
from fibctl.names import check_name
from fibctl.paths import expanded
from fibctl.hashes import short_hash
from fibctl import tomls

RECIPES_DIR = Path(__file__).resolve().parent.parent / "recipes"
KINDS = ("hub", "local", "installed-docs", "generated")
LOCAL_FORMATS = ("json", "parquet", "csv", "text")
MAX_VOCAB = 65536  # token ids are stored as uint16
MIN_VOCAB = 258  # the 256 byte tokens, the end-of-text token and one merge
MIN_TARGET = 2  # a source's training tokens: one of its text and the end-of-text that ends it
# the keys of one kind of source (the others apply to every kind): set on another kind, or
# another local format, they would be ignored without a word
KIND_KEYS = {"hub": ("text", "heldout_by", "dataset", "configs", "split", "revision"),
             "local": ("text", "heldout_by", "format", "files", "sample_by", "delimiter", "records"),
             "installed-docs": ("packages",), "generated": ("seed", "documents")}
FORMAT_KEYS = {"sample_by": "text", "delimiter": "csv", "records": "json"}
@dataclass(frozen=True)
class Source:
    """One corpus of the mixture. Which fields apply depends on `kind`."""

    name: str
    kind: str
    share: float  # of the training tokens
    heldout: str | None = None  # name of the held-out set this source's held-out documents form
    heldout_fraction: float = 0.02  # of documents, chosen by a hash of their text (or of heldout_by's)
    text: tuple[str, ...] = ("text",)  # fields joined (blank line between) into one document
    # the text fields whose text decides which documents are held out (documents alike in them
    # go together: all of a problem's solutions); None: the whole text
    heldout_by: tuple[str, ...] | None = None
    # hub
    dataset: str | None = None
    configs: tuple[str, ...] = ()  # several configs are interleaved document by document
    split: str = "train"
    revision: str | None = None
    # local
    format: str | None = None
    files: tuple[str, ...] = ()  # globs, relative to the recipe file
    sample_by: str = "document"  # for format "text": "line", "paragraph" or "document" (per file)
    delimiter: str = ","  # for format "csv": one character, e.g. "\t" or ";"
    # for format "json": the dotted path, in each file's one object, to the array of its
    # records (`data`: {"version": ..., "data": [...]}); None: the file's objects are the records
    records: str | None = None
    # installed-docs
    packages: tuple[str, ...] = ()  # empty: all of installed_docs.PACKAGES
    # generated
    seed: int = 0
    documents: int = 100_000


@dataclass(frozen=True)
class Recipe:
    name: str
    description: str
    vocab_size: int
    train_tokens: int
    heldout_tokens: int  # cap per held-out set; documents are kept whole
    tokenizer_sample_chars: int  # the tokenizer trains on this many characters of training text
    sources: tuple[Source, ...]

    @property
    def heldout(self) -> list[str]:
        """Held-out set names in recipe order."""
        return list(dict.fromkeys(s.heldout for s in self.sources if s.heldout))

    def check_heldout(self) -> None:
        """Refuse a recipe without a held-out set: `fibctl train` (and `worker`) evaluates every
        run on the held-out sets and `eval` scores them, so its data could train nothing, which
        `train` said only after the prepare (hours, for a corpus) was done."""
        if not self.heldout:
            first = self.sources[0].name  # a source's name, the recipe's text: shown escaped
            raise FibctlError(f"recipe {self.name!r} has no held-out set, which fibctl train and eval need: add "
                              f"heldout = \"NAME\" to a source (e.g. heldout = \"{printable(first)}_val\" in "
                              f"source {first!r})")

    def train_targets(self) -> list[int]:
        """Each source's training tokens: its share of train_tokens, rounded, the last source
        taking what is left so that they sum exactly to it."""
        targets = [round(s.share * self.train_tokens) for s in self.sources[:-1]]
        return [*targets, self.train_tokens - sum(targets)]

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @property
    def recipe_hash(self) -> str:
        """Hash of everything that shapes the output (not the name or description)."""
        d = self.to_dict()
        del d["name"], d["description"]
        for source in d["sources"]:  # keys added later leave, at their defaults, older hashes as they were
            for key in ("delimiter", "heldout_by", "records"):
                if source[key] == getattr(Source, key):
                    del source[key]
        return short_hash(d)

    def local_files(self, source: Source) -> list[str]:
        """The files a local source's globs match, sorted, each file once; error if a glob
        matches none (a typo beside a glob that matches would leave its files out unsaid).

        Folders are skipped (a `**` glob matches them). Paths reaching one file (a symlink,
        a hard link, a symlink loop under `**`) keep the first in sorted order, so no file is
        read twice.
        """
        where = f"source {source.name!r}"
        files = set()
        for pattern in source.files:
            matched, folders, looped = [], [], False
            for path in sorted(glob.glob(pattern, recursive=True)):
                try:
                    mode = os.stat(path).st_mode
                except FileNotFoundError:
                    if os.path.islink(path):
                        raise FibctlError(f"{where}: {shown_path(path)} is a broken link "
                                          f"(to {shown_path(os.readlink(path))})") from None
                    raise FibctlError(f"{where}: {shown_path(path)} is gone (deleted while reading?)") from None
                except OSError as e:
                    if e.errno != errno.ELOOP:
                        raise FibctlError(f"{where}: cannot read {shown_path(path)}: {e.strerror}") from None
                    try:  # a path too deep inside a loop of folder links: a shorter one reaches its file
                        os.stat(os.path.realpath(path))
                    except OSError:
                        raise FibctlError(f"{where}: {shown_path(path)} is a symlink loop") from None
                    looped = True
                    continue
                if stat.S_ISDIR(mode):
                    folders.append(path)
                    continue
                if not stat.S_ISREG(mode):
                    raise FibctlError(f"{where}: {shown_path(path)} is not a regular file (a pipe, socket or device)")
                matched.append(path)
            if not matched and not looped:
                if folders:
                    # a folder of folders: `*` would match only them, `**` every file at any depth
                    try:
                        deep = any(entry.is_dir() for entry in os.scandir(folders[0]))
                    except OSError:  # unreadable: the plain suggestion
                        deep = False
                    raise FibctlError(f"{where}: {shown_path(folders[0])} is a folder; name its files, e.g. "
                                      f"\"{shown_path(os.path.join(folders[0], '**' if deep else '*'))}\"")
                raise FibctlError(f"{where}: no files match {shown_path(pattern)}{_deeper(pattern)}")
            files.update(matched)
        found: dict[tuple[int, int], str] = {}  # the file -> the first path that matched it
        for path in sorted(files):
            found.setdefault(file_identity(path), path)
        return sorted(found.values())


def _deeper(pattern: str) -> str:
    """For a glob without `**` that matches no file: the glob that matches files in the
    subfolders of its folder (`corpus/**/*.txt` for `corpus/*.txt`), if one does."""
    folder, name = os.path.split(pattern)
    deeper = os.path.join(folder, "**", name)
    if "**" in pattern or not any(os.path.isfile(p) for p in glob.iglob(deeper, recursive=True)):
        return ""
    return f"; files in its subfolders match \"{shown_path(deeper)}\""


def file_identity(path: str) -> tuple[int, int]:
    """What tells one file from another whatever path reaches it (a symlink, a hard link)."""
    st = os.stat(path)
    return st.st_dev, st.st_ino


def shipped() -> list[str]:
    return sorted(p.stem for p in RECIPES_DIR.glob("*.toml"))


def shipped_for_vocab(vocab_size: int) -> str | None:
    """The shipped recipe whose tokenizer a run of this vocabulary trains on (the presets'
    vocabularies are the recipes': micro quick, tiny demo, paper paper), or None."""
    return next((name for name in shipped() if load_recipe(name).vocab_size == vocab_size), None)


def load_recipe(name_or_path: str | Path) -> Recipe:
    """A shipped recipe by name (`demo`) or a TOML file by path (`~` opening it: the home
    folder, as in its globs)."""
    path = Path(expanded(name_or_path))
    if not path.is_file():
        path = RECIPES_DIR / f"{name_or_path}.toml"
        if not path.is_file():
            raise FibctlError(f"no recipe {str(name_or_path)!r}: not a file, and not a shipped recipe "
                              f"({', '.join(shipped())})")
    try:
        data = tomls.loads(tomls.read(path))
    except (OSError, tomls.TomlError) as e:
        raise FibctlError(f"cannot read recipe {shown_path(path)}: {e}") from None
    try:
        return parse_recipe(data, default_name=path.stem, base_dir=path.parent)
    except FibctlError as e:  # which file is at fault: a recipe may be named folders away
        raise FibctlError(f"{shown_path(path)}: {e}") from None


def parse_recipe(data: dict, default_name: str = "recipe", base_dir: Path = Path(".")) -> Recipe:
    """Validate a recipe's TOML data; every error names the recipe key at fault."""
    data = dict(data)
    raw_sources = data.pop("sources", None)
    if not raw_sources:
        raise FibctlError("recipe has no [[sources]]")
    if not isinstance(raw_sources, list) or not all(isinstance(s, dict) for s in raw_sources):
        raise FibctlError("recipe `sources` must be [[sources]] tables, one per source")
    _check_keys("recipe", data, {f.name for f in dataclasses.fields(Recipe)} - {"sources"})
    for key in ("name", "description"):  # str() made a list or a number into a name without a word
        if key in data and not isinstance(data[key], str):
            raise FibctlError(f"recipe: {key}={data[key]!r} must be a string")
    recipe = Recipe(
        name=data.get("name", default_name),
        description=data.get("description", ""),
        vocab_size=_int(data, "vocab_size", "recipe", 32768),
        train_tokens=_int(data, "train_tokens", "recipe"),
        heldout_tokens=_int(data, "heldout_tokens", "recipe", 1_000_000),
        tokenizer_sample_chars=_int(data, "tokenizer_sample_chars", "recipe", 50_000_000),
        sources=tuple(_parse_source(s, base_dir, i) for i, s in enumerate(raw_sources, 1)),
    )
    _validate(recipe)
    return recipe


def _parse_source(raw: dict, base_dir: Path, number: int) -> Source:
    if "name" not in raw:  # check_name would say "source name None is not allowed"
        raise FibctlError(f"source {number} has no name: give it name = \"...\", the label of its documents")
    name = check_name("source", raw["name"])
    where = f"source {name!r}"
    _check_keys(where, raw, {f.name for f in dataclasses.fields(Source)})
    if raw.get("heldout") is not None:
        check_name(f"{where}: held-out set", raw["heldout"])
    if "kind" not in raw:
        raise FibctlError(f"{where} has no kind: give kind = one of {', '.join(KINDS)}")
    if raw.get("kind") not in KINDS:
        raise FibctlError(f"{where}: kind {raw.get('kind')!r} is not one of {', '.join(KINDS)}")
    fields = dict(raw)
    for key in ("text", "heldout_by", "configs", "files", "packages"):
        if key in fields:
            value = fields[key]
            if not isinstance(value, (str, list)) or not all(isinstance(v, str) for v in value):
                raise FibctlError(f"{where}: {key} must be a string or a list of strings, not {value!r}")
            fields[key] = (value,) if isinstance(value, str) else tuple(value)
    for key in ("dataset", "split", "revision", "format", "sample_by", "delimiter", "records"):
        if key in fields and not isinstance(fields[key], str):
            raise FibctlError(f"{where}: {key}={fields[key]!r} must be a string")
    for key in ("seed", "documents"):
        if key in fields and (not isinstance(fields[key], int) or isinstance(fields[key], bool)):
            raise FibctlError(f"{where}: {key}={fields[key]!r} must be an integer")
    for key in ("share", "heldout_fraction"):
        if key in fields:
            if not isinstance(fields[key], (int, float)) or isinstance(fields[key], bool):
                raise FibctlError(f"{where}: {key}={fields[key]!r} must be a number")
            fields[key] = float(fields[key])
    _check_applies(where, raw)
    if "files" in fields:  # relative to the recipe, stored absolute so the hash sees where they are
        # a TOML string may hold one ("\u0000"); expanduser and resolve raised ValueError, a traceback
        if nul := next((f for f in fields["files"] if "\0" in f), None):
            raise FibctlError(f"{where}: files {nul!r} holds a NUL character, which no path can")
        # `~` is the home folder, as in a shell (a file named `~` is `./~`)
        fields["files"] = tuple(str((base_dir / f).resolve()) if not Path(f).is_absolute() else f
                                for f in map(expanded, fields["files"]))
    try:
        return Source(**fields)
    except TypeError as e:
        raise FibctlError(f"{where}: {e}") from None


def _check_applies(where: str, raw: dict) -> None:
    """Refuse a key of another kind of source (`dataset` on a local one), or of another local
    format (`sample_by` on a JSON one): it would be ignored, and the recipe read as it does not say."""
    kind = raw["kind"]
    for key in raw:
        kinds = [k for k, keys in KIND_KEYS.items() if key in keys]
        if kinds and kind not in kinds:
            quoted = " or ".join(f'"{k}"' for k in kinds)
            raise FibctlError(f"{where}: {key} applies to kind {quoted} only, not {kind!r}")
        fmt = raw.get("format")
        if key in FORMAT_KEYS and fmt in LOCAL_FORMATS and fmt != FORMAT_KEYS[key]:
            raise FibctlError(f"{where}: {key} applies to format \"{FORMAT_KEYS[key]}\" only, not {fmt!r}")
    if "heldout_fraction" in raw and raw.get("heldout") is None:
        raise FibctlError(f"{where}: heldout_fraction applies to a source with a held-out set only; "
                          "set heldout = \"NAME\" too, or leave heldout_fraction out")


def _validate(r: Recipe) -> None:
    if not MIN_VOCAB <= r.vocab_size <= MAX_VOCAB:
        raise FibctlError(f"vocab_size {r.vocab_size:,} must be from {MIN_VOCAB} (the 256 bytes, the end-of-text "
                          f"token and one merge) to {MAX_VOCAB:,} (token ids are stored as uint16)")
    for key in ("train_tokens", "heldout_tokens", "tokenizer_sample_chars"):
        if getattr(r, key) < 1:
            raise FibctlError(f"recipe {key}={getattr(r, key)} must be >= 1")
    names = [s.name for s in r.sources]
    if len(set(names)) != len(names):
        raise FibctlError(f"source names must be unique: {', '.join(names)}")
    total = sum(s.share for s in r.sources)
    if abs(total - 1.0) > 1e-6:
        raise FibctlError(f"source shares sum to {total:g}; they must sum to 1")
    feeders = [s.heldout for s in r.sources if s.heldout]
    if len(set(feeders)) != len(feeders):
        raise FibctlError(f"each held-out set takes documents from one source: {', '.join(feeders)}")
    # split names are file names (NAME.bin): on a file system that ignores case, 'TRAIN.bin'
    # would be train.bin
    folded = [name.casefold() for name in feeders]
    if "train" in folded:
        raise FibctlError(f"a held-out set may not be named {feeders[folded.index('train')]!r}: its file would be "
                          "the training stream's")
    if len(set(folded)) != len(folded):
        raise FibctlError(f"held-out set names may not differ only by case: {', '.join(feeders)}")
    for s in r.sources:
        _validate_source(s)
    for s, target in zip(r.sources, r.train_targets()):
        # a one-token target has no room for any text beside the end-of-text: the source would
        # give no token at all (and a lone source, "no training documents")
        if target < MIN_TARGET:
            tokens = "no token" if target == 0 else "1 token" if target == 1 else f"{target} tokens"
            raise FibctlError(f"source {s.name!r}: share {s.share} of train_tokens={r.train_tokens} is {tokens} "
                              f"once the shares are rounded; raise train_tokens or its share (a source needs "
                              f"{MIN_TARGET} or more: its text and the end-of-text)")


def _validate_source(s: Source) -> None:
    where = f"source {s.name!r}"
    if not s.share > 0:
        raise FibctlError(f"{where}: share {s.share} must be > 0")
    _check_fields(where, "text", s.text)  # a field named twice: its text would be in each document twice
    if s.heldout_by is not None:
        _check_fields(where, "heldout_by", s.heldout_by)
        other = [f for f in s.heldout_by if f not in s.text]
        if other:  # the text fields are the ones each row is read for
            raise FibctlError(f"{where}: heldout_by names {other[0]!r}, which is not one of its text fields "
                              f"({', '.join(s.text)}); heldout_by names text fields only")
    if s.heldout and not 0 < s.heldout_fraction < 1:
        raise FibctlError(f"{where}: heldout_fraction {s.heldout_fraction} must be between 0 and 1")
    if s.kind == "hub" and not s.dataset:
        raise FibctlError(f"{where}: a hub source needs dataset = \"owner/name\"")
    if s.kind == "local":
        if s.format not in LOCAL_FORMATS:
            raise FibctlError(f"{where}: format {s.format!r} is not one of {', '.join(LOCAL_FORMATS)}")
        if not s.files:
            raise FibctlError(f"{where}: a local source needs files = [\"path/*.jsonl\", ...]")
        if s.sample_by not in ("line", "paragraph", "document"):
            raise FibctlError(f"{where}: sample_by {s.sample_by!r} is not line, paragraph or document")
        if len(s.delimiter) != 1:
            raise FibctlError(f"{where}: delimiter {s.delimiter!r} must be one character, e.g. \"\\t\" or \";\"")
        if s.records is not None and not all(s.records.split(".")):
            raise FibctlError(f"{where}: records {s.records!r} must be a dotted path of names, none empty "
                              "(e.g. \"data\")")
    if s.kind == "generated" and s.documents < 1:
        raise FibctlError(f"{where}: documents={s.documents} must be >= 1")


def _check_fields(where: str, key: str, fields: tuple[str, ...]) -> None:
    if not fields or not all(fields):
        raise FibctlError(f"{where}: {key} {list(fields)!r} must name one field or more, none empty")
    twice = [f for f in dict.fromkeys(fields) if fields.count(f) > 1]
    if twice:
        raise FibctlError(f"{where}: {key} names {twice[0]!r} twice; name each field once")


def _check_keys(where: str, data: dict, allowed: set[str]) -> None:
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise FibctlError(f"{where}: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(sorted(allowed))}")


def _int(data: dict, key: str, where: str, default: int | None = None) -> int:
    value = data.get(key, default)
    if value is None:
        raise FibctlError(f"{where}: {key} is required")
    if not isinstance(value, int) or isinstance(value, bool):
        raise FibctlError(f"{where}: {key}={value!r} must be an integer")
    return value
