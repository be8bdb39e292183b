# Locate cuda.h, the only CUDA file the build needs (the driver is dlopen'ed at run time).
# Looked for, in order: EMMPOOL_CUDA_INCLUDE_DIR, a CUDA toolkit (CUDA_HOME, CUDA_PATH,
# /usr/local/cuda, nvcc on PATH), then the headers of pip's NVIDIA CUDA wheels
# (nvidia-cuda-runtime: site-packages/nvidia/cu13/include or nvidia/cuda_runtime/include).
set(_emmpool_hints "")
foreach(_v CUDA_HOME CUDA_PATH CUDAToolkit_ROOT)
  if(DEFINED ENV{${_v}})
    list(APPEND _emmpool_hints "$ENV{${_v}}/include")
  endif()
endforeach()
find_program(_emmpool_nvcc nvcc)
if(_emmpool_nvcc)
  get_filename_component(_emmpool_nvcc_dir "${_emmpool_nvcc}" DIRECTORY)
  list(APPEND _emmpool_hints "${_emmpool_nvcc_dir}/../include")
endif()
list(APPEND _emmpool_hints /usr/local/cuda/include /opt/cuda/include)

find_package(Python 3.9 COMPONENTS Interpreter QUIET)
if(Python_EXECUTABLE)
  execute_process(
    COMMAND "${Python_EXECUTABLE}" -c
      "import site,sys; print(';'.join(site.getsitepackages()+[site.getusersitepackages()]+sys.path))"
    OUTPUT_VARIABLE _emmpool_paths OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
  foreach(_p ${_emmpool_paths})
    list(APPEND _emmpool_hints "${_p}/nvidia/cu13/include" "${_p}/nvidia/cu12/include"
         "${_p}/nvidia/cuda_runtime/include")
  endforeach()
endif()

find_path(EMMPOOL_CUDA_INCLUDE_DIR cuda.h HINTS ${_emmpool_hints})
if(NOT EMMPOOL_CUDA_INCLUDE_DIR)
  message(FATAL_ERROR
    "emmpool needs cuda.h to build (it does not link against CUDA). Either install a CUDA "
    "toolkit (and set CUDA_HOME), or `pip install nvidia-cuda-runtime` (which ships the headers) "
    "into the build environment, or pass -DEMMPOOL_CUDA_INCLUDE_DIR=/path/to/include.")
endif()
message(STATUS "emmpool: cuda.h from ${EMMPOOL_CUDA_INCLUDE_DIR}")
