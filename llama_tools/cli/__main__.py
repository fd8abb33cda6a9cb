"""`python -m llama_tools.cli`."""

from . import main

if __name__ == "__main__":  # importing it (a walk over every module) runs nothing
    main()
