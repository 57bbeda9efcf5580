"""placeholder"""


def install():
    pass
