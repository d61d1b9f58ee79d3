"""The episode event family: ``dev.rollbox.episode.annotate`` attaches an outcome (reward, labels) to
an episode at any time. It runs nothing; the step log records it as a row of the episode's
trajectory (so it is served only when recording is on)."""

from __future__ import annotations

from rollbox.functions.contract.models import EPISODE_ANNOTATE, AnnotateData
from rollbox.functions.handlers.routing import EventRef, Route, SandboxRuntime, route

__all__ = ["ROUTES", "annotate"]


async def annotate(_rt: SandboxRuntime, data: AnnotateData, _event: EventRef | None = None) -> AnnotateData:
    return data


ROUTES: tuple[Route, ...] = (route(EPISODE_ANNOTATE, annotate),)
