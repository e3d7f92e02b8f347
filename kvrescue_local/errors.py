"""The project's error type: a one-line message that names the fix."""


class KVRescueError(Exception):
    """Raised for every bad input or unusable environment; the CLI prints it as one line."""
