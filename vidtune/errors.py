"""The one error type of the data layer, and the one way a decoder's exception is shortened for it."""


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
