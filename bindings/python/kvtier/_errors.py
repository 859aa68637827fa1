"""KvtierError: a negative errno from libkvtier with the library's message."""

import errno as _errno


class KvtierError(Exception):
    """A libkvtier call failed.

    Attributes:
      code      the negative errno the C function returned (-22 for EINVAL)
      errno     the positive errno (22)
      name      its symbolic name ('EINVAL')
      message   kvt_last_error(): what was wrong, naming the field, variable
                or value (for a failed open: 'KVTIER_RANK=7: out of range ...')
      strerror  kvt_strerror(code): the code as a sentence
      func      the C function that failed ('kvt_open_v')
    """

    def __init__(self, code, message, strerror=None, func=None):
        code = int(code)
        if code > 0:
            code = -code
        self.code = code
        self.errno = -code
        self.name = _errno.errorcode.get(-code, "E%d" % -code)
        self.message = message
        self.strerror = strerror
        self.func = func
        super().__init__(code, message)

    def __str__(self):
        head = "%s: " % self.func if self.func else ""
        tail = " [%s: %s]" % (self.name, self.strerror) if self.strerror else " [%s]" % self.name
        return "%s%s%s" % (head, self.message, tail)

    def __reduce__(self):
        # Picklable across multiprocessing (the default would call
        # __init__ with self.args only).
        return (type(self), (self.code, self.message, self.strerror, self.func))
