"""The one error type of the data layer, the one way a decoder's exception is shortened for it,
and how a full disk is told from an exception, wherever it was raised."""
import errno


class DataError(ValueError):
    """Input data cannot be used. The message names the file or folder at fault and says what to do."""


def decoder_reason(e: BaseException) -> str:
    """The useful last line of a decord (FFmpeg) error, without its C++ source location."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()] or [type(e).__name__]
    if lines[-1].startswith("Error reading "):   # decord's whole message when FFmpeg rejects the file
        return "not a video format FFmpeg recognises, or the file is damaged"
    text = lines[-1].split("] ", 1)[-1]
    text = text.split(": ", 1)[-1] if ".cc:" in text else text
    return text[:160]


def no_space_left(error: BaseException | None) -> str | None:
    """The message that says `error` is a full disk (errno 28, ENOSPC), or None: an OSError with
    that errno along its cause/context chain, or that error's text in its message (an error raised
    in a Ray worker reaches the driver and Train's controller as text)."""
    e, seen = error, 0
    while e is not None and seen < 20:
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            return str(e)
        e = e.__cause__ or e.__context__
        seen += 1
    text = str(error or "")
    if "No space left on device" in text or "[Errno 28]" in text or "errno 28" in text:
        return "No space left on device"
    return None
