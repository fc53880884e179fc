"""Where an S3 client's credentials come from, and what to tell a user who gave none.

The sources, in obstore's order (plus the profile files, which this package reads for it,
pipeline/cache/object_store.py): AWS_ACCESS_KEY_ID with AWS_SECRET_ACCESS_KEY; the keys of the
profile AWS_PROFILE (else 'default') in the shared credentials and config files; a web identity
(AWS_WEB_IDENTITY_TOKEN_FILE with AWS_ROLE_ARN, as EKS sets); a container's role
(AWS_CONTAINER_CREDENTIALS_RELATIVE_URI / _FULL_URI, as ECS sets); unsigned requests
(AWS_SKIP_SIGNATURE=true); and, when none of these is there, the instance role, which obstore asks
the instance metadata service for (http://169.254.169.254, or AWS_METADATA_ENDPOINT) on the first
request.

Without any of them the store itself is never asked: the first request fails at the metadata
service (on a machine outside EC2 typically 403 from a proxy, or no answer), and obstore's error
reads like the bucket refused us ("403 Forbidden"). `missing_credentials` says, from the
environment and the files only (no request of its own: the metadata service can take seconds to
not answer), what was looked for; `explain` turns the client's error into one line that says what
is missing and how to give it. "No instance role found" is said only when the error shows that
the metadata service was asked and gave none; otherwise "no instance role is known".
"""

from __future__ import annotations

import configparser
import os
import re
from pathlib import Path

from pipeline.errors import PipelineError

METADATA_DEFAULT = "http://169.254.169.254"
HOW_TO_GIVE = ("set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (README, object stores), or AWS_PROFILE naming a "
               "profile with keys in the shared credentials file")


def _profile_name() -> str:
    return os.environ.get("AWS_PROFILE") or os.environ.get("AWS_DEFAULT_PROFILE") or "default"


def _files() -> tuple[Path, Path]:
    """(shared credentials file, config file) as the AWS tools find them."""
    home = Path.home() / ".aws"
    return (Path(os.environ.get("AWS_SHARED_CREDENTIALS_FILE") or home / "credentials"),
            Path(os.environ.get("AWS_CONFIG_FILE") or home / "config"))


def profile_settings() -> dict[str, str]:
    """The active profile's settings from the shared credentials and config files."""
    profile = _profile_name()
    credentials, config = _files()
    found: dict[str, str] = {}
    sources = [(config, "default" if profile == "default" else f"profile {profile}"), (credentials, profile)]
    for path, section in sources:
        parser = configparser.RawConfigParser()
        try:
            parser.read(path, encoding="utf-8")
        except (OSError, configparser.Error) as e:
            raise PipelineError(f"{path}: unreadable AWS settings file ({type(e).__name__})") from None
        if parser.has_section(section):
            found.update(parser.items(section))
    return found


def missing_credentials(profile: dict[str, str]) -> str | None:
    """What was looked for and not found, when no credential source is configured (the instance
    role aside, which only a request can find); None when one is."""
    env = os.environ
    if (env.get("AWS_ACCESS_KEY_ID") or profile.get("aws_access_key_id") or env.get("AWS_WEB_IDENTITY_TOKEN_FILE")
            or env.get("AWS_CONTAINER_CREDENTIALS_RELATIVE_URI") or env.get("AWS_CONTAINER_CREDENTIALS_FULL_URI")
            or env.get("AWS_SKIP_SIGNATURE", "").lower() == "true"):
        return None
    credentials, config = _files()
    name = _profile_name()
    profile_part = (f"profile '{name}' has no aws_access_key_id" if profile
                    else f"no profile '{name}'") + f" in {credentials} or {config}"
    return f"no AWS_ACCESS_KEY_ID in the environment, {profile_part}"


def _metadata_answer(text: str) -> str | None:
    """How the instance metadata service answered, when the client's error came from asking it."""
    endpoint = (os.environ.get("AWS_METADATA_ENDPOINT") or METADATA_DEFAULT).rstrip("/")
    if endpoint not in text and "/latest/api/token" not in text and "/latest/meta-data" not in text:
        return None
    status = re.search(r"non-2xx status code: (\d{3} [A-Za-z ]+)", text)
    answer = f"answered {status.group(1).strip()}" if status else "could not be reached"
    return f"no instance role found (the instance metadata service at {endpoint} {answer})"


def explain(missing: str, store_answer: str, error_text: str) -> str:
    """One line: what is missing, how to give it, and what the request met."""
    role = _metadata_answer(error_text)
    if role is not None:  # the request stopped at the metadata service: the bucket was never asked
        return f"no AWS credentials: {missing}, and {role}; {HOW_TO_GIVE}"
    return (f"{store_answer}; no AWS credentials were given: {missing}, and no instance role is known to be "
            f"available; {HOW_TO_GIVE}")
