"""The project's error type: a one-line message that names the fix."""


class KVRescueError(Exception):
    """Raised for every bad input or unusable environment; the CLI prints it as one line."""


class SettingError(KVRescueError):
    """A refused value of a setting, checked once below the interfaces: the message names settings by their
    RescueConfig fields in braces ("{kv.budget}"), and each interface words them in its own names (settings.py:
    `--budget` on the command line, `budget` in a served request). fields[0] is the setting at fault; str() gives
    the fields' own names."""

    def __init__(self, message: str, *fields: str) -> None:
        self.template, self.fields = message, fields
        super().__init__(self.worded(lambda field: field))

    def worded(self, name) -> str:
        """The message with each field named by name(field)."""
        text = self.template
        for field in self.fields:
            text = text.replace("{" + field + "}", name(field))
        return text
