"""Stand-ins for the two losses being added on another branch (``sogclr`` and ``fastclip``), with
the options study v2's config names, so that the v2 config's grid, sweeps and plan can be tested
before they are merged. They are registered only inside the tests that ask for them."""

from vlcontrast.losses.infonce import InfoNCELoss


class SogCLRStandIn(InfoNCELoss):
    def __init__(self, gamma: float = 0.9, gamma_schedule: str = "constant",
                 temperature: str = "fixed", *, chunk_size: int = 0, id_space: int = 0):
        super().__init__(chunk_size=chunk_size)


class FastCLIPStandIn(SogCLRStandIn):
    pass


def register(monkeypatch):
    from vlcontrast.losses import LOSSES

    monkeypatch.setitem(LOSSES, "sogclr", SogCLRStandIn)
    monkeypatch.setitem(LOSSES, "fastclip", FastCLIPStandIn)
