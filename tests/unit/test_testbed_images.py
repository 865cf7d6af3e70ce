"""The test bed kubelet's image handling that needs no registry: where a mount lands inside an image, which
user a container runs as, and what a pull policy does without the image (e2e/serving/test_images.py runs
the rest against the real registry)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from omnimodel_testbed.container import resolve_in_root
from omnimodel_testbed.images import Image, ImagePullError, ImageStore, image_user


def _image_root(tmp_path: Path) -> Path:
    root = tmp_path / "rootfs"
    (root / "run").mkdir(parents=True)
    (root / "usr" / "lib").mkdir(parents=True)
    (root / "var").mkdir()
    (root / "etc").mkdir()
    os.symlink("/run", root / "var" / "run")  # as Debian's images have it
    os.symlink("usr/lib", root / "lib")
    os.symlink("../../etc", root / "usr" / "lib" / "up")
    return root


def test_a_mount_follows_the_images_symlinks_inside_its_root(tmp_path: Path) -> None:
    root = _image_root(tmp_path)
    # Followed on this machine, /var/run/secrets would have landed on the host's /run.
    assert resolve_in_root(root, "/var/run/secrets/kubernetes.io/serviceaccount") == (
        "/run/secrets/kubernetes.io/serviceaccount"
    )
    assert resolve_in_root(root, "/lib/python3") == "/usr/lib/python3"
    assert resolve_in_root(root, "/lib/up/hosts") == "/etc/hosts"
    assert resolve_in_root(root, "/../../etc/resolv.conf") == "/etc/resolv.conf"
    assert resolve_in_root(root, "/tmp/not/yet") == "/tmp/not/yet"


def test_a_symlink_loop_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "rootfs"
    root.mkdir()
    os.symlink("/b", root / "a")
    os.symlink("/a", root / "b")
    with pytest.raises(RuntimeError, match="too many symlinks"):
        resolve_in_root(root, "/a/x")


def _image(tmp_path: Path, user: str) -> Image:
    root = tmp_path / "rootfs"
    (root / "etc").mkdir(parents=True, exist_ok=True)
    (root / "etc" / "passwd").write_text("root:x:0:0::/root:/bin/sh\nomnimodel:x:1000:1000::/tmp:/usr/sbin/nologin\n")
    (root / "etc" / "group").write_text("root:x:0:\nomnimodel:x:1000:\nvideo:x:44:\n")
    return Image("r/x:1", "sha256:" + "0" * 64, root, {"User": user})


@pytest.mark.parametrize(
    ("user", "expected"),
    [
        ("1000:1000", (1000, 1000)),
        ("1000", (1000, 1000)),  # the user's primary group in the image's /etc/passwd
        ("omnimodel", (1000, 1000)),
        ("omnimodel:video", (1000, 44)),
        ("4242", (4242, 0)),  # no entry: group 0, as runc
        ("", (0, 0)),
    ],
)
def test_the_images_user_unless_the_pod_names_one(tmp_path: Path, user: str, expected: tuple[int, int]) -> None:
    image = _image(tmp_path, user)
    assert image_user(image, None, None) == expected
    assert image_user(image, 2000, None) == (2000, expected[1])
    assert image_user(image, None, 3000) == (expected[0], 3000)


def test_an_unknown_user_name_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ImagePullError, match="unable to find user nobody-here") as info:
        image_user(_image(tmp_path, "nobody-here"), None, None)
    assert info.value.reason == "CreateContainerConfigError"


def test_never_without_the_image_is_err_image_never_pull(tmp_path: Path) -> None:
    store = ImageStore(tmp_path / "refs.json", cache=tmp_path / "cache")
    with pytest.raises(ImagePullError, match=re.escape('"127.0.0.1:1/x:1" is not present with pull policy')) as info:
        store.pull("127.0.0.1:1/x:1", "Never")
    assert info.value.reason == "ErrImageNeverPull"


def test_if_not_present_uses_the_nodes_record_without_asking_the_registry(tmp_path: Path) -> None:
    """The registry at 127.0.0.1:1 answers nothing: a pull that asked it would fail."""
    store = ImageStore(tmp_path / "refs.json", cache=tmp_path / "cache")
    digest = "sha256:" + "1" * 64
    rootfs = store.rootfs_dir / digest.replace(":", "-")
    rootfs.mkdir(parents=True)
    (rootfs.parent / f"{rootfs.name}.config.json").write_text(json.dumps({"User": "1000:1000", "Cmd": ["x"]}))
    (tmp_path / "refs.json").write_text(json.dumps({"127.0.0.1:1/omnimodel/x:1": digest}))
    image = store.pull("127.0.0.1:1/omnimodel/x:1", "IfNotPresent")
    assert (image.digest, image.cmd, image.image_id) == (digest, ["x"], f"127.0.0.1:1/omnimodel/x@{digest}")
    with pytest.raises(ImagePullError) as info:
        store.pull("127.0.0.1:1/omnimodel/x:1", "Always")
    assert info.value.reason == "ErrImagePull"
