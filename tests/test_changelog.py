"""Label discipline: patches/CHANGELOG.md's top entry is the current LOCAL_LABEL and records the
hash of the current series, so a change to patches/ that does not bump the label and add an entry
fails here (the message gives the hash to record)."""
import hashlib
import re

from shell import ROOT, pin, series


def series_hash():
    """sha256 (16 hex digits) of patches/series and every patch it lists, in order."""
    h = hashlib.sha256((ROOT / "patches" / "series").read_bytes())
    for name in series():
        h.update(name.encode() + b"\0" + (ROOT / "patches" / name).read_bytes())
    return h.hexdigest()[:16]


def entries():
    text = (ROOT / "patches" / "CHANGELOG.md").read_text()
    return re.findall(r"^## (\S+) \((\d{4}-\d\d-\d\d)\)\n(.*?)(?=^## |\Z)", text, re.M | re.S)


def test_top_entry_is_the_current_label_and_series():
    label, _, body = entries()[0]
    assert label == pin()["LOCAL_LABEL"], (
        f"patches/CHANGELOG.md's top entry is {label}, pin.env says {pin()['LOCAL_LABEL']}")
    recorded = re.search(r"^series sha256: ([0-9a-f]{16})$", body, re.M)
    assert recorded, f"the {label} entry records no series sha256"
    assert recorded.group(1) == series_hash(), (
        f"patches/ changed since {label} was recorded (series sha256 {series_hash()}, recorded "
        f"{recorded.group(1)}): bump LOCAL_LABEL in pin.env and add a CHANGELOG entry")
    assert re.search(r"^- GPU: ", body, re.M), f"the {label} entry says nothing about a GPU run"


def test_every_label_once_newest_first():
    labels = [e[0] for e in entries()]
    assert len(labels) == len(set(labels))
    numbers = [int(re.search(r"\.(\d+)$", l).group(1)) for l in labels]
    assert numbers == sorted(numbers, reverse=True)
    hashes = re.findall(r"^series sha256: (\S+)$", (ROOT / "patches" / "CHANGELOG.md").read_text(),
                        re.M)
    assert len(hashes) == len(set(hashes)), "two labels record the same series"
