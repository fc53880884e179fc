"""pytest skip marks for what a machine may lack: user and mount namespaces (a real full disk),
the [test] extra's S3 server and client."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from harness.s3_server import boto3


def _can_mount_a_tmpfs() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt"], capture_output=True)
    return probe.returncode == 0


# A real full disk: a small tmpfs mounted in a private user + mount namespace, grown later with
# `mount -o remount,size=...` to show the run resumes once there is room.
needs_tmpfs = pytest.mark.skipif(not _can_mount_a_tmpfs(), reason="needs user and mount namespaces (unshare -rm)")


needs_s3 = pytest.mark.skipif(boto3 is None, reason='needs the [test] extra (moto[server], obstore): pip install -e ".[test]"')
