# Finds the C++ Actor Framework (Debian's libcaf-dev ships neither a CMake config nor a
# pkg-config file). Creates CAF::core, CAF::io and CAF::openssl for the components found.
#
#   find_package(CAF REQUIRED COMPONENTS core io openssl)
#
# Sets CAF_FOUND, CAF_VERSION and CAF_INCLUDE_DIR.

find_path(CAF_INCLUDE_DIR NAMES caf/config.hpp)

if(CAF_INCLUDE_DIR AND EXISTS "${CAF_INCLUDE_DIR}/caf/config.hpp")
  file(STRINGS "${CAF_INCLUDE_DIR}/caf/config.hpp" _caf_version_line
       REGEX "^#define CAF_VERSION [0-9]+")
  string(REGEX REPLACE "^#define CAF_VERSION ([0-9]+).*" "\\1" _caf_v "${_caf_version_line}")
  math(EXPR _caf_major "${_caf_v} / 10000")
  math(EXPR _caf_minor "(${_caf_v} / 100) % 100")
  math(EXPR _caf_patch "${_caf_v} % 100")
  set(CAF_VERSION "${_caf_major}.${_caf_minor}.${_caf_patch}")
endif()

if(NOT CAF_FIND_COMPONENTS)
  set(CAF_FIND_COMPONENTS core)
endif()

foreach(_comp IN LISTS CAF_FIND_COMPONENTS)
  find_library(CAF_${_comp}_LIBRARY NAMES caf_${_comp})
  if(CAF_${_comp}_LIBRARY)
    set(CAF_${_comp}_FOUND TRUE)
  endif()
endforeach()

include(FindPackageHandleStandardArgs)
find_package_handle_standard_args(CAF
  REQUIRED_VARS CAF_INCLUDE_DIR
  VERSION_VAR CAF_VERSION
  HANDLE_COMPONENTS)

if(CAF_FOUND)
  find_package(Threads REQUIRED)
  foreach(_comp IN LISTS CAF_FIND_COMPONENTS)
    if(CAF_${_comp}_FOUND AND NOT TARGET CAF::${_comp})
      add_library(CAF::${_comp} UNKNOWN IMPORTED)
      set_target_properties(CAF::${_comp} PROPERTIES
        IMPORTED_LOCATION "${CAF_${_comp}_LIBRARY}"
        INTERFACE_INCLUDE_DIRECTORIES "${CAF_INCLUDE_DIR}"
        INTERFACE_LINK_LIBRARIES Threads::Threads)
    endif()
  endforeach()
  if(TARGET CAF::io AND TARGET CAF::core)
    set_property(TARGET CAF::io APPEND PROPERTY INTERFACE_LINK_LIBRARIES CAF::core)
  endif()
  if(TARGET CAF::openssl AND TARGET CAF::io)
    set_property(TARGET CAF::openssl APPEND PROPERTY INTERFACE_LINK_LIBRARIES CAF::io)
  endif()
endif()

mark_as_advanced(CAF_INCLUDE_DIR CAF_core_LIBRARY CAF_io_LIBRARY CAF_openssl_LIBRARY)
