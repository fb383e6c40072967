"""User-facing errors.

Anything the user can cause (a bad prompt, an unknown model id, an out-of-range parameter)
raises `DynaTreeError` with a one-line message that says what to do. The CLI prints it as
`error: <message>` and exits with status 2; the app shows it in an `st.error` box.
"""


class DynaTreeError(Exception):
    """An error caused by user input or environment, with a message meant for the user."""
