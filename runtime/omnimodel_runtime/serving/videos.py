"""``/v1/videos``: OpenAI's asynchronous video jobs over the text-to-video stage.

``create`` turns the request into one stage request and starts a background task that runs it; it answers
once the stage has *accepted* the request (the stage's first frame, sent after every check against the
model), so a size or frame count the model cannot make is a 400 naming the field, not a failed job. The
task then follows the stage's progress frames (``queued`` → ``in_progress`` with ``progress`` in percent)
and keeps the MP4 the stage sends (``completed``) or the error (``failed``). ``delete`` cancels a job
still running (closing its stream stops the stage's denoise loop at its next step) and forgets it.

Jobs live in this gateway process's memory: a restart loses them, queued, running and finished alike, and
with several gateway replicas a job is known only to the replica that created it. At most
:data:`MAX_JOBS` are kept; creating one more first forgets the oldest finished job (completed or failed),
and when every kept job is still queued or running the new one is refused with a 429.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Final

import numpy as np

from omnimodel_runtime.errors import StageError
from omnimodel_runtime.pipeline import Modality
from omnimodel_runtime.protocol.openai import random_id
from omnimodel_runtime.protocol.stage import FinalFrame, ResponseFrame, StageParams, StageRequest, TensorFrame
from omnimodel_runtime.protocol.videos import (
    VIDEO_TENSOR,
    VideoCreateRequest,
    VideoDeleted,
    VideoError,
    VideoList,
    VideoObject,
    VideoStatus,
)
from omnimodel_runtime.serving.base import Service, aclose, frames_of
from omnimodel_runtime.serving.errors import APIError
from omnimodel_runtime.serving.orchestrator import Orchestrator

log = logging.getLogger(__name__)

# Jobs kept per gateway. A finished 5 s 480p MP4 is a few MB, so this bounds memory to well under a GiB.
MAX_JOBS: Final = 100
MAX_LIST: Final = 100


@dataclass(eq=False)
class VideoJob:
    """One job: its OpenAI object's fields, its MP4 once done, the task running it."""

    id: str
    prompt: str
    created_at: int
    status: VideoStatus = "queued"
    progress: int = 0
    width: int = 0
    height: int = 0
    num_frames: int = 0
    fps: int = 1
    completed_at: int | None = None
    error: VideoError | None = None
    content: bytes | None = None
    task: asyncio.Task[None] | None = field(default=None, repr=False)

    @property
    def finished(self) -> bool:
        return self.status in ("completed", "failed")

    def accept(self, meta: dict[str, int]) -> None:
        self.width, self.height = int(meta["width"]), int(meta["height"])
        self.num_frames, self.fps = int(meta["num_frames"]), int(meta["fps"])

    def fail(self, err: StageError) -> None:
        code = err.code if isinstance(err, APIError) and err.code is not None else str(err.status)
        self.status = "failed"
        self.error = VideoError(code=str(code), message=err.message, type=err.type, param=err.param)
        self.completed_at = int(time.time())


class VideoService(Service):
    """The video jobs of one gateway (module docstring) over the stage chain that outputs video."""

    def __init__(self, orchestrator: Orchestrator, *, request_timeout: float, max_jobs: int = MAX_JOBS) -> None:
        super().__init__(orchestrator, request_timeout=request_timeout)
        self.max_jobs = max_jobs
        # Insertion order is creation order: the oldest first.
        self._jobs: OrderedDict[str, VideoJob] = OrderedDict()

    def video(self, job: VideoJob) -> VideoObject:
        return VideoObject(
            id=job.id,
            status=job.status,
            created_at=job.created_at,
            completed_at=job.completed_at,
            model=self.model_name,
            prompt=job.prompt,
            size=f"{job.width}x{job.height}",
            seconds=f"{job.num_frames / job.fps:.3g}",
            progress=job.progress,
            error=job.error,
            num_frames=job.num_frames,
            fps=job.fps,
        )

    async def create(self, req: VideoCreateRequest) -> VideoObject:
        """``POST /v1/videos``: the job, queued, once its stage has accepted it."""
        self.check_model(req.model)
        self._make_room()
        job = VideoJob(id=random_id("video"), prompt=req.prompt, created_at=int(time.time()))
        request = StageRequest(
            request_id=job.id,
            prompt=req.prompt,
            deadline=self.deadline(),
            stream=True,
            params=StageParams(video=req.params()),
        )
        accepted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        job.task = asyncio.create_task(self._run(job, request, accepted), name=f"video-{job.id}")
        try:
            await accepted
        except BaseException:
            job.task.cancel()
            raise
        self._jobs[job.id] = job
        # The job as it was accepted (OpenAI's create answers queued); an idle stage may have started it
        # since, which the next retrieve shows.
        return self.video(job).model_copy(update={"status": "queued", "progress": 0})

    def _make_room(self) -> None:
        while len(self._jobs) >= self.max_jobs:
            oldest = next((j for j in self._jobs.values() if j.finished), None)
            if oldest is None:
                raise APIError(
                    f"this server already holds {self.max_jobs} video jobs, none of them finished; "
                    "retry later or delete one",
                    status=429,
                    type="rate_limit_error",
                    code="too_many_jobs",
                )
            del self._jobs[oldest.id]

    async def _run(self, job: VideoJob, request: StageRequest, accepted: asyncio.Future[None]) -> None:
        """The job's background task: the stage's frames into the job's status."""
        frames: AsyncIterator[ResponseFrame] | None = None
        try:
            frames = frames_of(self.orchestrator.generate_chain(request, [Modality.VIDEO]))
            async for frame in frames:
                if isinstance(frame, TensorFrame):
                    self._take(job, frame, accepted)
                elif isinstance(frame, FinalFrame):
                    break
            if job.content is None:
                raise StageError("the stage finished without sending the video", status=502)
            job.status, job.progress, job.completed_at = "completed", 100, int(time.time())
        except asyncio.CancelledError:
            raise
        except StageError as err:
            if not accepted.done():
                accepted.set_exception(err)
                return
            log.warning("Video job %s failed: %s", job.id, err.message)
            job.fail(err)
        except Exception as err:
            log.exception("Video job %s failed", job.id)
            wrapped = StageError(f"the video job failed: {type(err).__name__}: {err}", status=500)
            if not accepted.done():
                accepted.set_exception(wrapped)
                return
            job.fail(wrapped)
        finally:
            if frames is not None:
                # Closing the stream now (a deleted job, an error) stops the stage's work on it.
                await aclose(frames)

    @staticmethod
    def _take(job: VideoJob, frame: TensorFrame, accepted: asyncio.Future[None]) -> None:
        meta = frame.meta
        if "accepted" in meta:
            job.accept(meta["accepted"])
            if not accepted.done():
                accepted.set_result(None)
        elif "progress" in meta:
            job.status = "in_progress"
            # Never 100 before the file is here; never backwards.
            job.progress = max(job.progress, min(99, int(meta["progress"])))
        elif VIDEO_TENSOR in frame.tensors:
            job.content = np.asarray(frame.tensors[VIDEO_TENSOR], dtype=np.uint8).tobytes()

    def _job(self, video_id: str) -> VideoJob:
        job = self._jobs.get(video_id)
        if job is None:
            raise APIError(
                f"no video with id {video_id!r} (jobs live in the gateway's memory; a restart forgets them)",
                status=404,
                type="invalid_request_error",
                param="video_id",
                code="video_not_found",
            )
        return job

    def retrieve(self, video_id: str) -> VideoObject:
        """``GET /v1/videos/{id}``."""
        return self.video(self._job(video_id))

    def list(self, *, after: str | None = None, limit: int = 20, order: str = "desc") -> VideoList:
        """``GET /v1/videos``: OpenAI's cursor list (``after`` an id, ``limit``, ``order`` by creation)."""
        jobs = list(self._jobs.values())
        if order == "desc":
            jobs.reverse()
        if after is not None:
            ids = [j.id for j in jobs]
            if after not in ids:
                raise APIError(f"after: no video with id {after!r}", status=400, param="after")
            jobs = jobs[ids.index(after) + 1 :]
        page = [self.video(j) for j in jobs[:limit]]
        return VideoList(
            data=page,
            first_id=page[0].id if page else None,
            last_id=page[-1].id if page else None,
            has_more=len(jobs) > limit,
        )

    def content(self, video_id: str) -> bytes:
        """``GET /v1/videos/{id}/content``: the MP4 once completed; a 409 naming the status before."""
        job = self._job(video_id)
        if job.content is None:
            raise APIError(
                f"video {video_id!r} is {job.status}: its content is there once it is completed",
                status=409,
                type="invalid_request_error",
                param="video_id",
                code="video_not_ready",
            )
        return job.content

    async def delete(self, video_id: str) -> VideoDeleted:
        """``DELETE /v1/videos/{id}``: forget the job, cancelling it first when it still runs."""
        job = self._job(video_id)
        del self._jobs[video_id]
        if job.task is not None and not job.task.done():
            job.task.cancel()
            await asyncio.gather(job.task, return_exceptions=True)
        return VideoDeleted(id=video_id)

    async def close(self) -> None:
        """Cancel every job still running (the gateway is stopping)."""
        tasks = [j.task for j in self._jobs.values() if j.task is not None and not j.task.done()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
