"""placeholder"""
def add_scaling_parser(kinds, add_engine_args, run):
    pass
