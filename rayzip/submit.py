"""``rayzip submit``: run a job spec on a Ray cluster through the Ray Jobs API.

The job's working directory holds the spec (and, with ``working_dir``, a folder of your code
for ``module:function`` models and datasets, copied beside it as :mod:`rayzip.package`
allows: ``.gitignore`` and ``.rayignore`` honoured, no symlink out of it, no credential
files); the entrypoint is
``python -m rayzip run SPEC`` on the cluster, whose Python must have rayzip installed. The submission id is derived from the spec's name and content: submitting the
same spec again attaches to the job already there instead of starting a duplicate; pass
``resubmit=True`` for a fresh run.

Clusters with token auth (the default for ``ray start`` since Ray 2.52): the client sends the
token from ``RAY_AUTH_TOKEN`` or ``~/.ray/auth_token``, as the ``ray`` CLI does.

Usage::

    status = submit_job(Path("jobs/digits-group-topk.yaml"), address="http://head:8265")
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable

from .package import package_working_dir
from .spec import JobSpec

__all__ = ["submission_id", "submit_job"]

TERMINAL = {"SUCCEEDED", "FAILED", "STOPPED"}
SPEC_NAME = "rayzip-job.yaml"


def submission_id(spec: JobSpec, spec_bytes: bytes) -> str:
    return f"rayzip-{spec.name}-{hashlib.sha256(spec_bytes).hexdigest()[:12]}"


def use_token_auth_if_available() -> bool:
    """Turn on token auth for this process when a token is at hand and no mode was chosen.

    Ray reads the token only in token mode; a cluster started with ``ray start`` requires it.
    """
    if os.environ.get("RAY_AUTH_MODE"):
        return os.environ["RAY_AUTH_MODE"] == "token"
    token_file = Path(os.environ.get("RAY_AUTH_TOKEN_PATH", Path.home() / ".ray" / "auth_token"))
    if os.environ.get("RAY_AUTH_TOKEN") or token_file.exists():
        os.environ["RAY_AUTH_MODE"] = "token"
        return True
    return False


def submit_job(spec_path: Path, spec: JobSpec, address: str | None = None, wait: bool = True,
               resubmit: bool = False, working_dir: Path | None = None,
               echo: Callable[[str], None] = print) -> tuple[str, str | None]:
    """Submit; with ``wait``, stream the logs and return the final status."""
    use_token_auth_if_available()  # before Ray is imported: it reads the mode once
    from ray.job_submission import JobSubmissionClient

    job_id = submission_id(spec, spec_path.read_bytes())
    if resubmit:
        job_id += time.strftime("-%Y%m%d-%H%M%S")
    with tempfile.TemporaryDirectory(prefix="rayzip-submit-") as package:
        # Packed before the cluster is contacted: a refused file stops the submission with
        # nothing sent.
        shipped = package_working_dir(working_dir, Path(package)) if working_dir is not None else None
        shutil.copy(spec_path, Path(package) / SPEC_NAME)
        client = JobSubmissionClient(address)
        existing = _status(client, job_id)
        if existing is None:
            if shipped is not None:
                echo(f"shipping {len(shipped.files)} files ({shipped.nbytes / 1e6:.2f} MB) from {working_dir}"
                     + (f"; left out symlinks that leave it or name directories: {', '.join(shipped.left_out_links)}"
                        if shipped.left_out_links else ""))
            client.submit_job(
                entrypoint=f"python -m rayzip run {SPEC_NAME}",
                submission_id=job_id,
                runtime_env={"working_dir": package},
                metadata={"rayzip_spec": spec.name},
            )
            echo(f"submitted {job_id}")
        else:
            echo(f"{job_id} was submitted before ({existing}); attaching to it (--resubmit runs it again)")
    if not wait:
        return job_id, None
    if existing in TERMINAL:  # its logs are complete: no stream to follow (a tail would idle)
        echo(client.get_job_logs(job_id).rstrip("\n"))
        return job_id, existing
    asyncio.run(_stream(client, job_id, echo))
    status = _status(client, job_id)
    while status not in TERMINAL:  # logs can end a moment before the status settles
        time.sleep(0.5)
        status = _status(client, job_id)
    return job_id, status


def _status(client, job_id: str) -> str | None:
    """The job's status name, or None when there is no such job."""
    try:
        return client.get_job_status(job_id).value
    except RuntimeError as exc:  # the client's way of saying "no such job"
        if "does not exist" in str(exc) or "404" in str(exc):
            return None
        raise


async def _stream(client, job_id: str, echo: Callable[[str], None]) -> None:
    async for lines in client.tail_job_logs(job_id):
        echo(lines.rstrip("\n"))
