# Locate cuda.h, the only CUDA file the build needs (the driver is dlopen'ed at run time, and
# nothing links against a CUDA library). Looked for, in order:
#   1. -DEMMPOOL_CUDA_INCLUDE_DIR=/path/to/include
#   2. a CUDA toolkit: find_package(CUDAToolkit) (nvcc on PATH, CUDAToolkit_ROOT, CUDA_PATH,
#      /usr/local/cuda), with CUDA_HOME as its root where set;
#   3. the headers of pip's nvidia-cuda-runtime wheel in the building Python's environment
#      (nvidia/cu13/include). `pip install .` builds in an isolated environment, which has the
#      wheel only if asked for it: EMMPOOL_CUDA_HEADERS=pip (pyproject.toml's override).
if(NOT EMMPOOL_CUDA_INCLUDE_DIR)
  if(NOT DEFINED CUDAToolkit_ROOT AND DEFINED ENV{CUDA_HOME})
    set(CUDAToolkit_ROOT "$ENV{CUDA_HOME}")
  endif()
  find_package(CUDAToolkit QUIET)
  if(CUDAToolkit_FOUND)
    find_path(EMMPOOL_CUDA_INCLUDE_DIR cuda.h HINTS ${CUDAToolkit_INCLUDE_DIRS} NO_DEFAULT_PATH)
  endif()
endif()

if(NOT EMMPOOL_CUDA_INCLUDE_DIR)
  find_package(Python 3.9 COMPONENTS Interpreter QUIET)
  if(Python_EXECUTABLE)
    execute_process(
      COMMAND "${Python_EXECUTABLE}" -c "import sys; print(';'.join(sys.path))"
      OUTPUT_VARIABLE _emmpool_paths OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
    set(_emmpool_hints "")
    foreach(_p ${_emmpool_paths})
      list(APPEND _emmpool_hints "${_p}/nvidia/cu13/include" "${_p}/nvidia/cuda_runtime/include")
    endforeach()
    find_path(EMMPOOL_CUDA_INCLUDE_DIR cuda.h HINTS ${_emmpool_hints} NO_DEFAULT_PATH)
  endif()
endif()

if(NOT EMMPOOL_CUDA_INCLUDE_DIR)
  message(FATAL_ERROR
    "emmpool needs cuda.h to build (only the header: it links against no CUDA library), and "
    "found none. Either install a CUDA toolkit (found through nvcc on PATH, CUDA_HOME or "
    "/usr/local/cuda), or let pip fetch the header with the nvidia-cuda-runtime wheel: "
    "EMMPOOL_CUDA_HEADERS=pip pip install . (or pass -DEMMPOOL_CUDA_INCLUDE_DIR=/path/to/include).")
endif()
message(STATUS "emmpool: cuda.h from ${EMMPOOL_CUDA_INCLUDE_DIR}")
