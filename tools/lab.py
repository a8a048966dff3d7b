"""The shape every lab shares: built on ``with``, torn down on exit, also when building fails."""


class Lab:
    def _up(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self):
        try:
            self._up()
        except BaseException:
            self.close()          # a half-built lab is removed too
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()
