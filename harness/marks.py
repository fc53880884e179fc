"""pytest marks for what a machine may lack: user and mount namespaces (a real full disk), the
[test] extra's S3 server and client. Each skips where it is missing, and fails under CI
(harness/prerequisites.py)."""

from __future__ import annotations

import shutil
import subprocess

from harness.prerequisites import needs
from harness.s3_server import boto3


def _can_mount_a_tmpfs() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt"], capture_output=True)
    return probe.returncode == 0


# A real full disk: a small tmpfs mounted in a private user + mount namespace, grown later with
# `mount -o remount,size=...` to show the run resumes once there is room.
needs_tmpfs = needs(_can_mount_a_tmpfs(), "needs user and mount namespaces (unshare -rm)")


needs_s3 = needs(boto3 is not None, 'needs the [test] extra (moto[server], obstore): pip install -e ".[test]"')
