# Note [CUDA build]
# LOCKSTEP_CUDA = AUTO (default) builds the CUDA device (src/tensor/cuda/, src/ops/cuda/) and the
# NCCL backend (src/distributed/nccl/) when CMake finds nvcc and the toolkit's libraries; ON makes
# a missing toolkit an error; OFF leaves them out. A build without them still parses "cuda:0" and
# says, when asked for such a tensor, that it has no CUDA support.
#
# Architectures: sm_80 (Ampere) and sm_90 (Hopper) machine code, plus sm_90 PTX so a newer GPU
# JIT-compiles it. CMAKE_CUDA_ARCHITECTURES overrides the list (a development build that compiles
# for one architecture only: -DCMAKE_CUDA_ARCHITECTURES=90-real).
#
# Sets LOCKSTEP_WITH_CUDA and defines lockstep_add_cuda(target).
set(LOCKSTEP_WITH_CUDA OFF)
if(NOT LOCKSTEP_CUDA MATCHES "^(AUTO|ON|OFF)$")
  message(FATAL_ERROR "LOCKSTEP_CUDA must be AUTO, ON or OFF, got '${LOCKSTEP_CUDA}'")
endif()

if(NOT LOCKSTEP_CUDA STREQUAL "OFF")
  # The toolkit's standard location, when nvcc is not on the PATH.
  if(NOT CMAKE_CUDA_COMPILER AND NOT DEFINED ENV{CUDACXX} AND EXISTS /usr/local/cuda/bin/nvcc)
    set(CMAKE_CUDA_COMPILER /usr/local/cuda/bin/nvcc)
  endif()
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
      set(CMAKE_CUDA_ARCHITECTURES 80-real 90-real 90-virtual)
    endif()
    enable_language(CUDA)
    # CMake 3.25 does not know nvcc 13's C++20 dialect; tell it the flag.
    if(NOT CMAKE_CUDA20_STANDARD_COMPILE_OPTION)
      set(CMAKE_CUDA20_STANDARD_COMPILE_OPTION "-std=c++20")
      set(CMAKE_CUDA20_EXTENSION_COMPILE_OPTION "-std=c++20")
      list(APPEND CMAKE_CUDA_COMPILE_FEATURES cuda_std_20)
    endif()
    find_package(CUDAToolkit)
    find_library(LOCKSTEP_NCCL_LIBRARY nccl HINTS ${CUDAToolkit_LIBRARY_DIR})
    find_path(LOCKSTEP_NCCL_INCLUDE nccl.h HINTS ${CUDAToolkit_INCLUDE_DIRS})
    find_library(LOCKSTEP_CUDNN_LIBRARY cudnn HINTS ${CUDAToolkit_LIBRARY_DIR})
    find_path(LOCKSTEP_CUDNN_INCLUDE cudnn.h HINTS ${CUDAToolkit_INCLUDE_DIRS})
    set(lockstep_cuda_missing "")
    if(NOT CUDAToolkit_FOUND)
      list(APPEND lockstep_cuda_missing "the CUDA toolkit (cudart)")
    endif()
    if(NOT TARGET CUDA::cublasLt)
      list(APPEND lockstep_cuda_missing "cuBLASLt")
    endif()
    if(NOT LOCKSTEP_NCCL_LIBRARY OR NOT LOCKSTEP_NCCL_INCLUDE)
      list(APPEND lockstep_cuda_missing "NCCL (nccl.h, libnccl)")
    endif()
    if(NOT LOCKSTEP_CUDNN_LIBRARY OR NOT LOCKSTEP_CUDNN_INCLUDE)
      list(APPEND lockstep_cuda_missing "cuDNN (cudnn.h, libcudnn)")
    endif()
    if(lockstep_cuda_missing)
      set(lockstep_cuda_why "nvcc found but not: ${lockstep_cuda_missing}")
    else()
      set(LOCKSTEP_WITH_CUDA ON)
      # For the installed package config: where find_package(lockstep) looks for the toolkit.
      get_filename_component(LOCKSTEP_CUDA_TOOLKIT_ROOT "${CUDAToolkit_BIN_DIR}" DIRECTORY)
    endif()
  else()
    set(lockstep_cuda_why "no nvcc found (set CUDACXX or put the toolkit's bin/ on the PATH)")
  endif()
  if(NOT LOCKSTEP_WITH_CUDA)
    if(LOCKSTEP_CUDA STREQUAL "ON")
      message(FATAL_ERROR "LOCKSTEP_CUDA=ON but ${lockstep_cuda_why}")
    endif()
    message(STATUS "lockstep: building without CUDA: ${lockstep_cuda_why}")
  else()
    message(STATUS "lockstep: CUDA ${CUDAToolkit_VERSION} for architectures "
                   "${CMAKE_CUDA_ARCHITECTURES}; NCCL ${LOCKSTEP_NCCL_LIBRARY}; cuDNN "
                   "${LOCKSTEP_CUDNN_LIBRARY}")
  endif()
else()
  message(STATUS "lockstep: building without CUDA (LOCKSTEP_CUDA=OFF)")
endif()

function(lockstep_add_cuda target)
  set_target_properties(${target} PROPERTIES CUDA_STANDARD 20 CUDA_STANDARD_REQUIRED ON
                                             CUDA_SEPARABLE_COMPILATION OFF)
  target_compile_definitions(${target} PUBLIC LOCKSTEP_WITH_CUDA)
  target_compile_options(${target} PRIVATE
    $<$<COMPILE_LANGUAGE:CUDA>:--expt-relaxed-constexpr --extended-lambda -Xcompiler=-Wall,-Wno-unused-parameter>)
  target_include_directories(${target} PRIVATE ${LOCKSTEP_NCCL_INCLUDE} ${LOCKSTEP_CUDNN_INCLUDE})
  target_link_libraries(${target} PRIVATE CUDA::cudart CUDA::cublasLt CUDA::cublas
                                          ${LOCKSTEP_NCCL_LIBRARY} ${LOCKSTEP_CUDNN_LIBRARY})
endfunction()
